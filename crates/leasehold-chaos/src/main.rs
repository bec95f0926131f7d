//! `leasehold-chaos`: the checker as a program of its own (the `leasehold chaos` command
//! runs the same code).

fn main() {}
