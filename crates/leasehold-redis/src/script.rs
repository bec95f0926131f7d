//! The Lua scripts and the shape of every call of them, defined once.
//!
//! A lock name's keys are [`Key`]s and a call's arguments are [`Arg`]s, each with the name
//! the scripts use for it (`LOCK`, `OWNER`). A [`Shape`] lists what one kind of call passes,
//! in order; from it come both the command ([`Call::cmd`]) and the Lua lines that name what
//! the script received (`local LOCK, TOKEN = KEYS[1], KEYS[2]`), put in front of the
//! script's body. So positions are written nowhere by hand: a body uses names only, and a
//! shape that passes parts in another order changes the command and the names together.
//!
//! Redis charges a script call for every key and argument it is passed, so each kind of
//! call passes only what its path may touch (see [`Calls`]), and an optional argument is
//! left off the end while it has its default value.

use std::sync::LazyLock;

use leasehold_core::backend::{Mode, Request};
use leasehold_core::{LockName, NamePrefix};
use redis::Script;

use crate::eviction;

/// A key of one lock name: `<prefix>:{<name>}:<suffix>`.
/// All keys of a name share the hash tag `{<name>}`, so they live in one Redis Cluster
/// slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Key {
    /// The exclusive holder's value, and the gate of the acquire fast path (see `lua/head.lua`).
    Lock,
    /// Fair waiters: zset `<mode><owner>` → arrival.
    Queue,
    /// Every waiter (`~<mode><owner>` if not fair): zset → expiry (ms).
    Qexp,
    /// Lock-delay of the lock set: zset owner → end of its delay.
    Delay,
    /// The exclusive holder's stored value.
    Xinfo,
    /// The fencing counter.
    Token,
    /// Shared holders: zset owner → expiry (ms).
    Readers,
    /// Shared holders' `token|value`, by owner.
    Rinfo,
    /// Permit holders: zset owner → expiry (ms).
    Permits,
    /// Permit holders' `token|value`, by owner.
    Pinfo,
    /// Lock-delay of the permit set.
    Pdelay,
    /// The name's latest evictions: a list of records, newest first (see `eviction.rs`).
    Evicted,
    /// A record kept beside the lock: `<prefix>:{<name>}:rec:<record key>`.
    /// The one kind of key with a part of its own after the suffix: the call's record key
    /// ([`Values::record_key`]). See `lua/put_record.lua`.
    Record,
}

impl Key {
    /// The keys of a name's lock sets, in the order calls that pass all of them pass them.
    pub(crate) const STATE: [Key; 11] = [
        Key::Lock,
        Key::Queue,
        Key::Qexp,
        Key::Delay,
        Key::Xinfo,
        Key::Token,
        Key::Readers,
        Key::Rinfo,
        Key::Permits,
        Key::Pinfo,
        Key::Pdelay,
    ];

    /// The keys an inspect reads: its lock sets' ([`Key::STATE`]), then its eviction records.
    pub(crate) const INSPECTED: [Key; 12] = {
        let mut all = [Key::Evicted; 12];
        let mut i = 0;
        while i < Key::STATE.len() {
            all[i] = Key::STATE[i];
            i += 1;
        }
        all
    };

    /// Every kind of key a script may be passed: [`Key::INSPECTED`], then a record.
    pub(crate) const ALL: [Key; 13] = {
        let mut all = [Key::Record; 13];
        let mut i = 0;
        while i < Key::INSPECTED.len() {
            all[i] = Key::INSPECTED[i];
            i += 1;
        }
        all
    };

    /// The last part of the key.
    pub(crate) const fn suffix(self) -> &'static str {
        match self {
            Key::Lock => "lock",
            Key::Queue => "queue",
            Key::Qexp => "qexp",
            Key::Delay => "delay",
            Key::Xinfo => "xinfo",
            Key::Token => "token",
            Key::Readers => "readers",
            Key::Rinfo => "rinfo",
            Key::Permits => "permits",
            Key::Pinfo => "pinfo",
            Key::Pdelay => "pdelay",
            Key::Evicted => "evicted",
            Key::Record => "rec",
        }
    }

    /// The key's name in the scripts.
    pub(crate) const fn lua(self) -> &'static str {
        match self {
            Key::Lock => "LOCK",
            Key::Queue => "QUEUE",
            Key::Qexp => "QEXP",
            Key::Delay => "DELAY",
            Key::Xinfo => "XINFO",
            Key::Token => "TOKEN",
            Key::Readers => "READERS",
            Key::Rinfo => "RINFO",
            Key::Permits => "PERMITS",
            Key::Pinfo => "PINFO",
            Key::Pdelay => "PDELAY",
            Key::Evicted => "EVICTED",
            Key::Record => "RECORD_KEY",
        }
    }
}

/// The last part of a name's wake-up channel, `<prefix>:{<name>}:wake`.
/// A channel is not a key: scripts get it as an argument ([`Arg::Channel`]).
pub(crate) const WAKE: &str = "wake";

/// An argument of a script call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arg {
    /// The owner id.
    Owner,
    /// Mode (`x`, `s`, `p`), then `1`/`0` for each flag.
    /// The flags are fair, waiting, has a value, fresh token on adoption (a Redlock node).
    /// `x1000`.
    Flags,
    /// The lease in whole milliseconds.
    Ttl,
    /// The name's wake-up channel.
    Channel,
    /// The permit limit (0 unless a permit).
    Limit,
    /// The lock-delay in milliseconds (0: none).
    LockDelay,
    /// The value stored with the grant.
    Value,
    /// The lowest value the fencing counter may have afterwards (`raise`).
    Floor,
    /// How long after its start a Redlock node refuses grants, in ms (0: no quarantine).
    Quarantine,
    /// The token of the grant to evict.
    Grant,
    /// The record to store: an eviction's (see `eviction.rs`), or one beside the lock.
    Record,
    /// How long a record beside the lock is kept, in whole milliseconds.
    Keep,
    /// Where a fair waiter queues: its place's score (0: after the last waiter).
    /// A Redlock node's waiters pass when their acquisition began, so that every node
    /// queues them in one order.
    Place,
}

impl Arg {
    /// Every argument, in the order of the bindings.
    pub(crate) const ALL: [Arg; 13] = [
        Arg::Owner,
        Arg::Flags,
        Arg::Ttl,
        Arg::Channel,
        Arg::Limit,
        Arg::LockDelay,
        Arg::Value,
        Arg::Floor,
        Arg::Quarantine,
        Arg::Grant,
        Arg::Record,
        Arg::Keep,
        Arg::Place,
    ];

    /// The argument's name in the scripts.
    pub(crate) const fn lua(self) -> &'static str {
        match self {
            Arg::Owner => "OWNER",
            Arg::Flags => "FLAGS",
            Arg::Ttl => "TTL",
            Arg::Channel => "CHANNEL",
            Arg::Limit => "LIMIT",
            Arg::LockDelay => "LOCK_DELAY",
            Arg::Value => "VALUE",
            Arg::Floor => "FLOOR",
            Arg::Quarantine => "QUARANTINE",
            Arg::Grant => "GRANT",
            Arg::Record => "RECORD",
            Arg::Keep => "KEEP",
            Arg::Place => "PLACE",
        }
    }

    /// What a script sees when a call does not pass the argument (a Lua string literal).
    /// An optional argument whose value is this is left off the end of a call.
    const fn lua_default(self) -> &'static str {
        match self {
            Arg::Flags => "'x0000'",
            Arg::Owner | Arg::Channel | Arg::Value | Arg::Record => "''",
            Arg::Ttl
            | Arg::Limit
            | Arg::LockDelay
            | Arg::Floor
            | Arg::Quarantine
            | Arg::Grant
            | Arg::Keep
            | Arg::Place => "'0'",
        }
    }
}

/// What one kind of call passes.
/// `keys` in this order, then `args` in this order — the first `required` always, the
/// others up to the last one that differs from its default.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) keys: &'static [Key],
    pub(crate) args: &'static [Arg],
    pub(crate) required: usize,
}

impl Shape {
    /// The Lua lines that name what a call of this shape passes.
    /// Parts it does not pass are named too (keys `nil`, arguments their defaults), so a
    /// body can test for them.
    pub(crate) fn bindings(&self) -> String {
        fn bind(out: &mut String, names: &[&str], values: &[String]) {
            if !names.is_empty() {
                out.push_str(&format!(
                    "local {} = {}\n",
                    names.join(", "),
                    values.join(", ")
                ));
            }
        }
        let mut out = String::from("-- Generated from the call's shape (src/script.rs).\n");
        let keys: Vec<&str> = self.keys.iter().map(|k| k.lua()).collect();
        let positions: Vec<String> = (1..=keys.len()).map(|i| format!("KEYS[{i}]")).collect();
        bind(&mut out, &keys, &positions);
        let absent: Vec<&str> = Key::ALL
            .iter()
            .filter(|k| !self.keys.contains(k))
            .map(|k| k.lua())
            .collect();
        if !absent.is_empty() {
            out.push_str(&format!("local {} -- not passed\n", absent.join(", ")));
        }
        for (i, arg) in self.args.iter().enumerate() {
            let value = if i < self.required {
                format!("ARGV[{}]", i + 1)
            } else {
                format!("ARGV[{}] or {}", i + 1, arg.lua_default())
            };
            bind(&mut out, &[arg.lua()], &[value]);
        }
        let (names, values): (Vec<&str>, Vec<String>) = Arg::ALL
            .iter()
            .filter(|a| !self.args.contains(a))
            .map(|a| (a.lua(), a.lua_default().to_owned()))
            .unzip();
        bind(&mut out, &names, &values);
        out
    }
}

/// The shared pieces a body includes at its `-- @<name>` markers.
const PIECES: [(&str, &str); 5] = [
    ("-- @token", include_str!("../lua/token.lua")),
    ("-- @quarantine", include_str!("../lua/quarantine.lua")),
    ("-- @prologue", include_str!("../lua/prologue.lua")),
    ("-- @head", include_str!("../lua/head.lua")),
    ("-- @common", include_str!("../lua/common.lua")),
];

/// One kind of script call: a body, the shape of the call, and the script they make.
#[derive(Debug)]
pub(crate) struct Call {
    pub(crate) name: &'static str,
    pub(crate) shape: Shape,
    /// The script's text: the bindings, then the body with its pieces.
    text: String,
    script: Script,
}

impl Call {
    /// A call whose script starts with the Lua lines `bindings` (after the shape's).
    fn with(name: &'static str, shape: Shape, bindings: &str, body: &str) -> Self {
        let mut text = shape.bindings();
        text.push_str(bindings);
        let mut body = body.to_owned();
        for (marker, piece) in PIECES {
            body = body.replacen(marker, piece, 1);
        }
        text.push_str(&body);
        Self {
            name,
            shape,
            script: Script::new(&text),
            text,
        }
    }

    /// The script (to load it again after `NOSCRIPT`).
    pub(crate) fn script(&self) -> &Script {
        &self.script
    }

    /// The script's text (to load it).
    pub(crate) fn script_code(&self) -> &str {
        &self.text
    }

    /// The `EVALSHA` of this call with `keys` and the arguments in `values`.
    pub(crate) fn cmd(&self, keys: &Keys, values: &Values<'_>) -> redis::Cmd {
        let shape = &self.shape;
        let optional = &shape.args[shape.required..];
        let sent = shape.required
            + optional
                .iter()
                .rposition(|&arg| !values.is_default(arg))
                .map_or(0, |last| last + 1);
        let args = &shape.args[..sent];
        // Sized up front: the command is written once, without growing.
        let mut cmd = redis::Cmd::with_capacity(
            3 + shape.keys.len() + args.len(),
            96 + shape.keys.len() * (keys.text.len() + 4)
                + values.record_key.len()
                + values.len(args),
        );
        cmd.arg("EVALSHA")
            .arg(self.script.get_hash())
            .arg(shape.keys.len());
        for &key in shape.keys {
            match key {
                Key::Record => keys.write_record(&mut cmd, values.record_key),
                key => keys.write(&mut cmd, key),
            }
        }
        for &arg in args {
            values.write(&mut cmd, arg, keys);
        }
        cmd
    }
}

/// Every kind of script call.
///
/// Exclusive releases and renewals pass few keys: a release four (the lock, the queue's
/// two keys and the counter, for a hand-off to the next waiter; five with a lock-delay, six
/// with a stored value) and the owner and channel; a renewal one (five with a lock-delay or
/// a value). The acquire fast path is a call of its
/// own with two keys and two arguments. Every other call passes the keys of both lock sets
/// ([`Key::STATE`]); inspect adds the eviction records, and an eviction passes the keys of
/// the holders it may remove, their lock-delays and the records. A record's write passes
/// the keys that say who holds (the lock, readers and permits) and the record's key.
#[derive(Debug)]
pub(crate) struct Calls {
    /// The exclusive fast path: free → granted, else 0 (make the full call).
    pub(crate) acquire_fast: Call,
    pub(crate) acquire: Call,
    /// A Redlock node's acquire calls: tokens from the counter alone (see `token.lua`).
    pub(crate) node_acquire_fast: Call,
    pub(crate) node_acquire: Call,
    pub(crate) renew_exclusive: Call,
    /// An exclusive renewal with a lock-delay or a stored value.
    pub(crate) renew_exclusive_more: Call,
    pub(crate) renew: Call,
    pub(crate) release_exclusive: Call,
    pub(crate) release_exclusive_delayed: Call,
    /// An exclusive release with a stored value (and maybe a lock-delay).
    pub(crate) release_exclusive_valued: Call,
    pub(crate) release: Call,
    pub(crate) inspect: Call,
    pub(crate) raise: Call,
    /// A force release (`lua/evict.lua`).
    pub(crate) evict: Call,
    /// A grant left to end at the hold (`Backend::keep`).
    /// A renewal to it that also wakes the waiters, since the lease may now end sooner
    /// than they were told.
    pub(crate) keep: Call,
    /// A record written beside the lock while the owner's grant holds (`lua/put_record.lua`).
    pub(crate) put_record: Call,
    /// A record deleted if it is still the given value (`lua/drop_record.lua`).
    pub(crate) drop_record: Call,
}

const EXCLUSIVE_RELEASE_KEYS: [Key; 5] = [Key::Lock, Key::Queue, Key::Qexp, Key::Delay, Key::Xinfo];
/// An exclusive release's keys: a renewal's, and the counter for the token of a hand-off.
const HANDING_RELEASE_KEYS: [Key; 6] = [
    Key::Lock,
    Key::Queue,
    Key::Qexp,
    Key::Token,
    Key::Delay,
    Key::Xinfo,
];

/// The calls for a server, made (and their scripts hashed) once per process.
/// Their scripts publish wake-ups with `PUBLISH`.
pub(crate) static CALLS: LazyLock<Calls> = LazyLock::new(|| Calls::new("PUBLISH"));

/// The calls for a Redis Cluster, whose scripts publish wake-ups with `SPUBLISH`.
/// The message stays on the lock's own shard (the channel shares the lock's hash tag).
pub(crate) static SHARDED_CALLS: LazyLock<Calls> = LazyLock::new(|| Calls::new("SPUBLISH"));

impl Calls {
    /// Every kind of call, its scripts publishing wake-ups with the command `publish`.
    fn new(publish: &str) -> Calls {
        use Arg::*;
        let publish = format!("local PUBLISH = '{publish}'\n");
        let call = |name, shape, body| Call::with(name, shape, &publish, body);
        let with = |name, shape, bindings: &str, body| {
            Call::with(name, shape, &format!("{publish}{bindings}"), body)
        };
        let acquire = include_str!("../lua/acquire.lua");
        let renew = include_str!("../lua/renew.lua");
        let release = include_str!("../lua/release.lua");
        let all = &Key::STATE;
        let shape = |keys, args, required| Shape {
            keys,
            args,
            required,
        };
        let acquire_fast = include_str!("../lua/acquire_fast.lua");
        let fast_shape = shape(&[Key::Lock, Key::Token], &[Owner, Ttl, Quarantine], 2);
        let acquire_shape = shape(
            all,
            &[
                Owner, Flags, Ttl, Channel, Limit, LockDelay, Value, Quarantine, Place,
            ],
            4,
        );
        const CLOCK_FLOOR: &str = "local CLOCK_FLOOR = true\n";
        const COUNTER_ONLY: &str = "local CLOCK_FLOOR = false\n";
        let records = format!(
            "local RECORDS_KEPT, RECORDS_TTL = {}, {}\n",
            eviction::KEPT,
            millis_up(eviction::KEPT_FOR)
        );
        const EVICT_KEYS: [Key; 9] = [
            Key::Lock,
            Key::Delay,
            Key::Xinfo,
            Key::Readers,
            Key::Rinfo,
            Key::Permits,
            Key::Pinfo,
            Key::Pdelay,
            Key::Evicted,
        ];
        Calls {
            acquire_fast: with("acquire (fast path)", fast_shape, CLOCK_FLOOR, acquire_fast),
            acquire: with("acquire", acquire_shape, CLOCK_FLOOR, acquire),
            node_acquire_fast: with(
                "acquire (fast path)",
                fast_shape,
                COUNTER_ONLY,
                acquire_fast,
            ),
            node_acquire: with("acquire", acquire_shape, COUNTER_ONLY, acquire),
            renew_exclusive: call("renew", shape(&[Key::Lock], &[Owner, Ttl], 2), renew),
            renew_exclusive_more: call(
                "renew",
                shape(&EXCLUSIVE_RELEASE_KEYS, &[Owner, Ttl, LockDelay], 2),
                renew,
            ),
            renew: call(
                "renew",
                shape(all, &[Owner, Flags, Ttl, LockDelay], 3),
                renew,
            ),
            release_exclusive: with(
                "release",
                shape(&HANDING_RELEASE_KEYS[..4], &[Owner, Channel, Place], 2),
                CLOCK_FLOOR,
                release,
            ),
            release_exclusive_delayed: with(
                "release",
                shape(&HANDING_RELEASE_KEYS[..5], &[Owner, Channel, Place], 2),
                CLOCK_FLOOR,
                release,
            ),
            release_exclusive_valued: with(
                "release",
                shape(&HANDING_RELEASE_KEYS, &[Owner, Channel, Place], 2),
                CLOCK_FLOOR,
                release,
            ),
            release: with(
                "release",
                shape(all, &[Owner, Flags, Channel, Limit, Place], 3),
                CLOCK_FLOOR,
                release,
            ),
            inspect: with(
                "inspect",
                shape(&Key::INSPECTED, &[], 0),
                &records,
                include_str!("../lua/inspect.lua"),
            ),
            raise: call(
                "raise",
                shape(all, &[Owner, Flags, Floor], 3),
                include_str!("../lua/raise.lua"),
            ),
            evict: with(
                "evict",
                shape(&EVICT_KEYS, &[Owner, Flags, Channel, Grant, Record], 5),
                &records,
                include_str!("../lua/evict.lua"),
            ),
            keep: call(
                "keep",
                shape(all, &[Owner, Flags, Ttl, Channel, LockDelay], 4),
                renew,
            ),
            put_record: call(
                "put record",
                shape(
                    &[Key::Lock, Key::Readers, Key::Permits, Key::Record],
                    &[Owner, Flags, Keep, Record],
                    4,
                ),
                include_str!("../lua/put_record.lua"),
            ),
            drop_record: call(
                "drop record",
                shape(&[Key::Record], &[Record], 1),
                include_str!("../lua/drop_record.lua"),
            ),
        }
    }
}

impl Calls {
    /// Every call (to load their scripts).
    pub(crate) fn all(&self) -> [&Call; 17] {
        [
            &self.acquire_fast,
            &self.acquire,
            &self.node_acquire_fast,
            &self.node_acquire,
            &self.renew_exclusive,
            &self.renew_exclusive_more,
            &self.renew,
            &self.release_exclusive,
            &self.release_exclusive_delayed,
            &self.release_exclusive_valued,
            &self.release,
            &self.inspect,
            &self.raise,
            &self.evict,
            &self.keep,
            &self.put_record,
            &self.drop_record,
        ]
    }

    /// The acquire calls, fast path and full, for a single server or a Redlock node.
    pub(crate) fn acquire_of(&self, redlock_node: bool) -> (&Call, &Call) {
        if redlock_node {
            (&self.node_acquire_fast, &self.node_acquire)
        } else {
            (&self.acquire_fast, &self.acquire)
        }
    }

    /// The release of `req`.
    /// An exclusive one passes the keys its path may touch (with a lock-delay its entries,
    /// with a value the stored value); others every key.
    pub(crate) fn release_of(&self, req: &Request) -> &Call {
        match req.mode {
            Mode::Exclusive if req.value.is_some() => &self.release_exclusive_valued,
            Mode::Exclusive if req.lock_delay.is_some() => &self.release_exclusive_delayed,
            Mode::Exclusive => &self.release_exclusive,
            _ => &self.release,
        }
    }

    /// The renewal of `req`.
    /// An exclusive one passes the lock alone, or with its stored value and lock-delay
    /// entries; others every key.
    pub(crate) fn renew_of(&self, req: &Request) -> &Call {
        match req.mode {
            _ if renews_in_batch(req) => &self.renew_exclusive,
            Mode::Exclusive => &self.renew_exclusive_more,
            _ => &self.renew,
        }
    }
}

/// Whether `req`'s renewal can go in a [`RENEW_MANY`] batch.
/// That is an exclusive grant without a lock-delay or a stored value, whose lease is its
/// lock key's expiry.
pub(crate) fn renews_in_batch(req: &Request) -> bool {
    req.mode == Mode::Exclusive && req.value.is_none() && req.lock_delay.is_none()
}

/// Many exclusive renewals in one script call (`lua/renew_many.lua`).
/// It passes one key (the lock) and two arguments (owner, lease in ms) per grant. The one
/// call whose length varies, so
/// it has no [`Shape`]; [`renew_many_cmd`] writes it.
pub(crate) static RENEW_MANY: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW_MANY_CODE));

/// The text of [`RENEW_MANY`] (to load it).
pub(crate) const RENEW_MANY_CODE: &str = include_str!("../lua/renew_many.lua");

/// The `EVALSHA` of [`RENEW_MANY`] for the grants of `reqs`.
/// Each [`renews_in_batch`]; `keys` are their keys.
pub(crate) fn renew_many_cmd(reqs: &[&Request], keys: &[Keys]) -> redis::Cmd {
    let mut cmd = redis::Cmd::with_capacity(
        3 + 3 * reqs.len(),
        64 + keys.iter().map(|k| k.text.len() + 4).sum::<usize>()
            + reqs
                .iter()
                .map(|r| r.owner.as_str().len() + 8)
                .sum::<usize>(),
    );
    cmd.arg("EVALSHA")
        .arg(RENEW_MANY.get_hash())
        .arg(reqs.len());
    for keys in keys {
        keys.write(&mut cmd, Key::Lock);
    }
    for req in reqs {
        cmd.arg(req.owner.as_str()).arg(millis_up(req.ttl));
    }
    cmd
}

/// The keys of one lock name and its wake-up channel.
/// They are kept as the channel's name `<prefix>:{<name>}:wake`: a call writes the keys it
/// passes straight into its command.
#[derive(Debug)]
pub(crate) struct Keys {
    text: String,
    /// The length of `<prefix>:{<name>}:`, which every key and the channel start with.
    base: usize,
}

impl Keys {
    pub(crate) fn new(prefix: &str, name: &LockName) -> Self {
        let name = name.as_str();
        let mut text = String::with_capacity(prefix.len() + name.len() + 4 + WAKE.len());
        text.push_str(prefix);
        text.push_str(":{");
        text.push_str(name);
        text.push_str("}:");
        let base = text.len();
        text.push_str(WAKE);
        Keys { text, base }
    }

    /// The name's wake-up channel.
    pub(crate) fn channel(&self) -> &str {
        &self.text
    }

    /// A `SCAN` pattern for the keys of kind `kinds` of the names beginning with `names`.
    /// The pattern may match more (keys of other kinds, keys not leasehold's):
    /// [`name_in`](Keys::name_in) tells them apart. Neither a key prefix nor a name
    /// prefix contains a glob character (`check_key_prefix`, [`NamePrefix`]), so both go
    /// into the pattern as they are.
    pub(crate) fn pattern(prefix: &str, names: &NamePrefix, kinds: &[Key]) -> String {
        let mut pattern = format!("{prefix}:{{{}*}}:", names.as_str());
        // One character class per position the suffixes have in common.
        let shortest = kinds.iter().map(|k| k.suffix().len()).min().unwrap_or(0);
        for i in 0..shortest {
            let mut class: Vec<u8> = kinds.iter().map(|k| k.suffix().as_bytes()[i]).collect();
            class.sort_unstable();
            class.dedup();
            pattern.push('[');
            pattern.extend(class.into_iter().map(char::from));
            pattern.push(']');
        }
        pattern.push('*');
        pattern
    }

    /// The lock name of `key` if it is a key of one of `kinds` under `prefix`.
    pub(crate) fn name_in(prefix: &str, key: &[u8], kinds: &[Key]) -> Option<LockName> {
        let rest = std::str::from_utf8(key)
            .ok()?
            .strip_prefix(prefix)?
            .strip_prefix(":{")?;
        let (name, suffix) = rest.split_once("}:")?;
        kinds
            .iter()
            .any(|k| k.suffix() == suffix)
            .then(|| LockName::new(name).ok())?
    }

    /// The full name of `key` (for tests and messages; calls write keys in place).
    /// A [`Key::Record`] is the record `window:1`'s.
    #[cfg(test)]
    pub(crate) fn key(&self, key: Key) -> String {
        let tail = if key == Key::Record { ":window:1" } else { "" };
        format!("{}{}{tail}", &self.text[..self.base], key.suffix())
    }

    /// Writes the key as the command's next argument.
    pub(crate) fn write(&self, cmd: &mut redis::Cmd, key: Key) {
        self.write_parts(cmd, &[key.suffix()]);
    }

    /// Writes the key of the record `record_key` ([`Key::Record`]) as the command's next argument.
    pub(crate) fn write_record(&self, cmd: &mut redis::Cmd, record_key: &str) {
        self.write_parts(cmd, &[Key::Record.suffix(), ":", record_key]);
    }

    /// Writes `<prefix>:{<name>}:` and `parts` as the command's next argument.
    fn write_parts(&self, cmd: &mut redis::Cmd, parts: &[&str]) {
        use redis::RedisWrite;
        use std::io::Write;
        let mut arg = cmd.writer_for_next_arg();
        // Writing into the command's buffer cannot fail.
        let _ = arg.write_all(&self.text.as_bytes()[..self.base]);
        for part in parts {
            let _ = arg.write_all(part.as_bytes());
        }
    }
}

/// The values of a call's arguments.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Values<'a> {
    pub(crate) req: &'a Request,
    /// [`Arg::Floor`].
    pub(crate) floor: u64,
    /// [`Arg::Quarantine`]: set for a Redlock node only.
    pub(crate) quarantine_ms: u64,
    /// A Redlock node: an owner that holds already gets a fresh token (see `acquire.lua`).
    pub(crate) fresh_token: bool,
    /// [`Arg::Grant`].
    pub(crate) grant: u64,
    /// [`Arg::Record`].
    pub(crate) record: &'a [u8],
    /// [`Arg::Keep`], in whole milliseconds.
    pub(crate) keep_ms: u64,
    /// The key of the record beside the lock, for a call that passes [`Key::Record`].
    pub(crate) record_key: &'a str,
    /// [`Arg::Place`].
    pub(crate) place: u64,
}

impl<'a> Values<'a> {
    /// The values of a call for `req`.
    pub(crate) fn of(req: &'a Request) -> Self {
        Self {
            req,
            floor: 0,
            quarantine_ms: 0,
            fresh_token: false,
            grant: 0,
            record: b"",
            keep_ms: 0,
            record_key: "",
            place: 0,
        }
    }

    fn limit(&self) -> u32 {
        match self.req.mode {
            Mode::Permit { limit } => limit.get(),
            _ => 0,
        }
    }

    fn lock_delay(&self) -> u64 {
        self.req.lock_delay.map_or(0, millis_up)
    }

    fn value(&self) -> &[u8] {
        self.req.value.as_deref().unwrap_or_default()
    }

    fn is_default(&self, arg: Arg) -> bool {
        match arg {
            Arg::Limit => self.limit() == 0,
            Arg::LockDelay => self.lock_delay() == 0,
            Arg::Value => self.value().is_empty(),
            Arg::Floor => self.floor == 0,
            Arg::Quarantine => self.quarantine_ms == 0,
            Arg::Grant => self.grant == 0,
            Arg::Record => self.record.is_empty(),
            Arg::Keep => self.keep_ms == 0,
            Arg::Place => self.place == 0,
            // Always passed when in a shape.
            Arg::Owner | Arg::Flags | Arg::Ttl | Arg::Channel => false,
        }
    }

    /// About how many bytes the arguments take.
    fn len(&self, args: &[Arg]) -> usize {
        let value = if args.contains(&Arg::Value) {
            self.value().len()
        } else {
            0
        };
        let record = if args.contains(&Arg::Record) {
            self.record.len()
        } else {
            0
        };
        self.req.owner.as_str().len() + value + record + 24 * args.len()
    }

    fn write(&self, cmd: &mut redis::Cmd, arg: Arg, keys: &Keys) {
        match arg {
            Arg::Owner => cmd.arg(self.req.owner.as_str()),
            Arg::Flags => cmd.arg(&self.flags()[..]),
            Arg::Ttl => cmd.arg(millis_up(self.req.ttl)),
            Arg::Channel => cmd.arg(keys.channel()),
            Arg::Limit => cmd.arg(self.limit()),
            Arg::LockDelay => cmd.arg(self.lock_delay()),
            Arg::Value => cmd.arg(self.value()),
            Arg::Floor => cmd.arg(self.floor),
            Arg::Quarantine => cmd.arg(self.quarantine_ms),
            Arg::Grant => cmd.arg(self.grant),
            Arg::Record => cmd.arg(self.record),
            Arg::Keep => cmd.arg(self.keep_ms),
            Arg::Place => cmd.arg(self.place),
        };
    }

    fn flags(&self) -> [u8; 5] {
        let flag = |on: bool| if on { b'1' } else { b'0' };
        let mode = match self.req.mode {
            Mode::Exclusive => b'x',
            Mode::Shared => b's',
            Mode::Permit { .. } => b'p',
        };
        [
            mode,
            flag(self.req.fair),
            flag(self.req.waiting),
            flag(self.req.value.is_some()),
            flag(self.fresh_token),
        ]
    }
}

/// Whole milliseconds, rounded up (Redis expiries are in ms; never grant less than asked).
pub(crate) fn millis_up(d: std::time::Duration) -> u64 {
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    u64::try_from(ms).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::time::Duration;

    use leasehold_core::OwnerId;

    use super::*;

    fn request() -> Request {
        let mut req = Request::new(
            LockName::new("orders:42").unwrap(),
            OwnerId::parse("o1").unwrap(),
            Mode::Exclusive,
            Duration::from_micros(1_500_500),
        );
        req.fair = true;
        req
    }

    /// The command's arguments after EVALSHA and the hash: key count, keys, arguments.
    fn sent(call: &Call, values: &Values<'_>) -> (Vec<String>, Vec<String>) {
        let keys = Keys::new("leasehold", &values.req.name);
        let packed = String::from_utf8(call.cmd(&keys, values).get_packed_command()).unwrap();
        let args: Vec<String> = packed
            .split("\r\n")
            .skip(2)
            .step_by(2)
            .map(str::to_owned)
            .collect();
        assert_eq!(args[0], "EVALSHA");
        assert_eq!(args[1], call.script.get_hash());
        let n: usize = args[2].parse().unwrap();
        (args[3..3 + n].to_vec(), args[3 + n..].to_vec())
    }

    /// What the generated Lua binds to `KEYS[i]` and `ARGV[i]`.
    /// It is read back from the text of the script (not from the shape).
    fn bound(call: &Call) -> (BTreeMap<usize, String>, BTreeMap<usize, String>) {
        let (mut keys, mut argv) = (BTreeMap::new(), BTreeMap::new());
        let header = call.shape.bindings();
        for line in header.lines().filter_map(|l| l.strip_prefix("local ")) {
            let Some((names, values)) = line.split_once(" = ") else {
                continue;
            };
            for (name, value) in names.split(", ").zip(values.split(", ")) {
                let at = |prefix: &str| {
                    value
                        .strip_prefix(prefix)
                        .and_then(|v| v.split(']').next())
                        .map(|i| i.parse::<usize>().unwrap())
                };
                if let Some(i) = at("KEYS[") {
                    keys.insert(i, name.to_owned());
                }
                if let Some(i) = at("ARGV[") {
                    argv.insert(i, name.to_owned());
                }
            }
        }
        (keys, argv)
    }

    /// The key a script names `lua`, by its suffix.
    fn suffix_of(lua: &str) -> &'static str {
        Key::ALL.iter().find(|k| k.lua() == lua).unwrap().suffix()
    }

    #[test]
    fn every_call_names_each_key_and_argument_where_the_command_puts_it() {
        let plain = request();
        let mut full = request();
        full.mode = Mode::Permit {
            limit: std::num::NonZeroU32::new(3).unwrap(),
        };
        full.lock_delay = Some(Duration::from_millis(40));
        full.value = Some(b"v".as_slice().into());
        for req in [&plain, &full] {
            let values = Values {
                floor: 7,
                quarantine_ms: 250,
                fresh_token: true,
                grant: 9,
                record: b"r",
                keep_ms: 5,
                record_key: "done:1",
                ..Values::of(req)
            };
            for call in CALLS.all() {
                let (keys, args) = sent(call, &values);
                let (key_names, arg_names) = bound(call);
                assert_eq!(key_names.len(), keys.len(), "{}", call.name);
                for (i, key) in keys.iter().enumerate() {
                    let name = &key_names[&(i + 1)];
                    let tail = if name == "RECORD_KEY" { ":done:1" } else { "" };
                    assert_eq!(
                        key,
                        &format!("leasehold:{{orders:42}}:{}{tail}", suffix_of(name)),
                        "{}: KEYS[{}] is {name} in the script",
                        call.name,
                        i + 1
                    );
                }
                for (i, arg) in args.iter().enumerate() {
                    let name = &arg_names[&(i + 1)];
                    let expected = match name.as_str() {
                        "OWNER" => "o1".to_owned(),
                        "TTL" => "1501".to_owned(),
                        "CHANNEL" => "leasehold:{orders:42}:wake".to_owned(),
                        "FLAGS" if req.value.is_some() => "p1011".to_owned(),
                        "FLAGS" => "x1001".to_owned(),
                        "LIMIT" => if req.value.is_some() { "3" } else { "0" }.to_owned(),
                        "LOCK_DELAY" => if req.value.is_some() { "40" } else { "0" }.to_owned(),
                        "VALUE" => if req.value.is_some() { "v" } else { "" }.to_owned(),
                        "FLOOR" => "7".to_owned(),
                        "QUARANTINE" => "250".to_owned(),
                        "GRANT" => "9".to_owned(),
                        "RECORD" => "r".to_owned(),
                        "KEEP" => "5".to_owned(),
                        other => panic!("{other} is not an argument"),
                    };
                    assert_eq!(arg, &expected, "{}: ARGV[{}] is {name}", call.name, i + 1);
                }
            }
        }
    }

    #[test]
    fn the_fast_paths_pass_only_what_they_touch() {
        let req = request();
        let values = Values::of(&req);
        let key = |k: Key| Keys::new("leasehold", &req.name).key(k);
        assert_eq!(
            sent(&CALLS.acquire_fast, &values),
            (
                vec![key(Key::Lock), key(Key::Token)],
                vec!["o1".to_owned(), "1501".to_owned()]
            )
        );
        // An exclusive release: the lock, the queue's two keys, the counter; the owner and
        // channel.
        assert_eq!(
            sent(CALLS.release_of(&req), &values),
            (
                vec![
                    key(Key::Lock),
                    key(Key::Queue),
                    key(Key::Qexp),
                    key(Key::Token)
                ],
                vec!["o1".to_owned(), "leasehold:{orders:42}:wake".to_owned()]
            )
        );
        // An exclusive renewal: the lock alone; owner and ttl.
        assert_eq!(sent(CALLS.renew_of(&req), &values).0, vec![key(Key::Lock)]);
        // Defaults are left off the end; a Redlock quarantine brings the ones before it.
        let (_, args) = sent(&CALLS.acquire, &values);
        assert_eq!(args.len(), 4);
        let quarantined = Values {
            quarantine_ms: 250,
            ..values
        };
        assert_eq!(sent(&CALLS.acquire, &quarantined).1.len(), 8);
        assert_eq!(
            sent(&CALLS.acquire_fast, &quarantined).1,
            ["o1", "1501", "250"]
        );
        let mut delayed = request();
        delayed.lock_delay = Some(Duration::from_millis(40));
        assert_eq!(sent(CALLS.release_of(&delayed), &values).0.len(), 5);
        assert_eq!(sent(CALLS.renew_of(&delayed), &values).0.len(), 5);
    }

    /// Bodies use names only.
    /// `KEYS[n]` and `ARGV[n]` appear in the generated bindings and nowhere else, and every
    /// upper-case name a body uses (outside comments and strings) is bound by the shape or
    /// defined by the body.
    #[test]
    fn bodies_use_names_not_positions() {
        let bound: BTreeSet<&str> = Key::ALL
            .iter()
            .map(|k| k.lua())
            .chain(Arg::ALL.iter().map(|a| a.lua()))
            .collect();
        for call in CALLS.all() {
            let body = &call.text[call.shape.bindings().len()..];
            let code = lua_code(body);
            assert!(
                !code.contains("KEYS") && !code.contains("ARGV"),
                "{}: a position in the body",
                call.name
            );
            let defined: BTreeSet<&str> = code
                .lines()
                .filter_map(|l| l.trim_start().strip_prefix("local "))
                .flat_map(|l| l.split('=').next().unwrap_or("").split(','))
                .map(str::trim)
                .collect();
            for word in code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.len() > 1 && word.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                    assert!(
                        bound.contains(word) || defined.contains(word),
                        "{}: {word} is neither bound nor defined",
                        call.name
                    );
                }
            }
        }
    }

    /// Lua source without its comments and string literals.
    fn lua_code(source: &str) -> String {
        let mut out = String::new();
        for line in source.lines() {
            let mut quote: Option<char> = None;
            let mut chars = line.chars().peekable();
            while let Some(c) = chars.next() {
                match quote {
                    Some(_) if c == '\\' => {
                        chars.next();
                    }
                    Some(q) if c == q => quote = None,
                    Some(_) => {}
                    None if c == '\'' || c == '"' => quote = Some(c),
                    None if c == '-' && chars.peek() == Some(&'-') => break,
                    None => out.push(c),
                }
            }
            out.push('\n');
        }
        out
    }

    /// Whether `text` matches `pattern`, for the globs [`Keys::pattern`] writes.
    /// Literal characters, character classes without ranges, and `*`.
    fn glob(pattern: &[u8], text: &[u8]) -> bool {
        match pattern.split_first() {
            None => text.is_empty(),
            Some((b'*', rest)) => (0..=text.len()).any(|i| glob(rest, &text[i..])),
            Some((b'[', rest)) => {
                let end = rest.iter().position(|&c| c == b']').unwrap();
                text.split_first().is_some_and(|(c, tail)| {
                    rest[..end].contains(c) && glob(&rest[end + 1..], tail)
                })
            }
            Some((c, rest)) => text
                .split_first()
                .is_some_and(|(t, tail)| t == c && glob(rest, tail)),
        }
    }

    #[test]
    fn a_listing_pattern_finds_the_names_of_its_kinds_of_key() {
        let kinds = [Key::Lock, Key::Permits];
        let names = NamePrefix::new("jobs:").unwrap();
        let pattern = Keys::pattern("app:v2", &names, &kinds);
        assert_eq!(pattern, "app:v2:{jobs:*}:[lp][eo][cr][km]*");
        let name = LockName::new("jobs:nightly").unwrap();
        let keys = Keys::new("app:v2", &name);
        for key in Key::ALL {
            let text = keys.key(key);
            let listed = kinds.contains(&key);
            assert_eq!(glob(pattern.as_bytes(), text.as_bytes()), listed, "{text}");
            let found = Keys::name_in("app:v2", text.as_bytes(), &kinds);
            assert_eq!(found.as_ref(), listed.then_some(&name), "{text}");
        }
        // A record is no lock, whatever its key: not even one named like a lock's keys. A
        // record key has no `}` (that would let the pattern's `*` run on to a `}:lock`).
        let mut record = redis::cmd("GET");
        for record_key in ["lock", "permits", "permits:x", "x:lock", "lockpermits"] {
            let record_key = leasehold_core::RecordKey::new(record_key).unwrap();
            keys.write_record(&mut record, record_key.as_str());
        }
        assert!(leasehold_core::RecordKey::new("a}:lock").is_err());
        let packed = String::from_utf8(record.get_packed_command()).unwrap();
        for text in packed.split("\r\n").skip(4).step_by(2) {
            assert!(text.starts_with("app:v2:{jobs:nightly}:rec:"), "{text}");
            assert!(!glob(pattern.as_bytes(), text.as_bytes()), "{text}");
            assert_eq!(Keys::name_in("app:v2", text.as_bytes(), &kinds), None);
        }
        // Other names, other prefixes and keys not leasehold's are not found.
        let other = Keys::new("app:v2", &LockName::new("orders:1").unwrap());
        assert!(!glob(pattern.as_bytes(), other.key(Key::Lock).as_bytes()));
        for key in [
            "app:v2:{jobs:a}:lockx",
            "app:v3:{jobs:a}:lock",
            "app:v2:jobs:a:lock",
            "app:v2:{jobs/a}:lock",
        ] {
            assert_eq!(
                Keys::name_in("app:v2", key.as_bytes(), &kinds),
                None,
                "{key}"
            );
        }
        // The empty prefix finds every name.
        let every = Keys::pattern("leasehold", &NamePrefix::default(), &kinds);
        assert!(glob(every.as_bytes(), b"leasehold:{orders:1}:permits"));
        assert!(!glob(every.as_bytes(), other.key(Key::Permits).as_bytes()));
    }

    #[test]
    fn ttls_round_up_to_whole_milliseconds() {
        assert_eq!(millis_up(Duration::from_micros(1500)), 2);
        assert_eq!(millis_up(Duration::from_millis(3)), 3);
        assert_eq!(millis_up(Duration::from_nanos(1)), 1);
    }
}
