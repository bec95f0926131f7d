//! The in-memory backend's links, over core's `Faulty`.
//! One sits between each in-process worker and the server it shares a process with.

use std::sync::Arc;
use std::time::Duration;

use leasehold::Error;
use leasehold::backend::Backend;
use leasehold_chaos::harness::Link;
use leasehold_testkit::faulty::{Faulty, Op};

/// A link around `backend`.
pub(crate) fn link(backend: Arc<dyn Backend>) -> Arc<dyn Link> {
    Arc::new(FaultyLink(Faulty::wrap(backend)))
}

#[derive(Debug)]
struct FaultyLink(Faulty);

impl Link for FaultyLink {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.0.clone())
    }

    fn apply(&self, action: &str, delay_ms: u64) {
        let faulty = &self.0;
        if action == "lose_reply" {
            faulty.lose_next_reply(Op::Acquire);
            return;
        }
        const OPS: [Op; 5] = [Op::Acquire, Op::Renew, Op::Release, Op::Wait, Op::Inspect];
        for op in OPS {
            match action {
                "cut_to_server" | "cut_both" => faulty.hold_requests(op),
                "cut_to_client" => faulty.hold_replies(op),
                "delay" => faulty.delay_replies(op, Duration::from_millis(delay_ms)),
                "heal" => faulty.resume(op),
                "reset" => {
                    faulty.fail_next(op, Error::unavailable("connection reset by the nemesis"))
                }
                _ => {}
            }
        }
    }
}
