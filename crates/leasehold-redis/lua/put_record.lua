-- put_record: write RECORD under RECORD_KEY, beside the lock, if OWNER's grant in MODE is
-- still held (checked as a renewal checks it), and keep it KEEP ms. The check and the write
-- are one step, so a holder that lost its grant writes nothing. Returns 1 if written, 0 if
-- the grant is not held.
--
-- RECORD_KEY is `<prefix>:{<name>}:rec:<key>`: in the lock's slot (its hash tag), and no
-- kind of key a listing looks for (src/listing.rs).
-- @prologue
-- @head
-- @common

if not holds_grant(now_ms()) then return 0 end
redis.call('SET', RECORD_KEY, RECORD, 'PX', KEEP)
return 1
