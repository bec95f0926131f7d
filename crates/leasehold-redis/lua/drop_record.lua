-- drop_record: delete the record under RECORD_KEY if it is still RECORD, the value this
-- client wrote. A Redlock write that fell short of a majority takes itself back this way,
-- and never a later holder's record. Returns 1 if deleted, else 0.
if redis.call('GET', RECORD_KEY) == RECORD then
  redis.call('DEL', RECORD_KEY)
  return 1
end
return 0
