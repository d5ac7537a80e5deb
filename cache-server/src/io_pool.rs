//! A bounded pool of I/O threads. Tier I/O (NVMe reads and writes) runs here, never on the
//! caller's async runtime. The queue is bounded: background work that does not fit is refused
//! (and counted by the caller), foreground work waits for room.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender, TrySendError, bounded};

type Job = Box<dyn FnOnce() + Send>;

/// Jobs waiting in the queue, at most.
pub const IO_QUEUE_DEPTH: usize = 1024;

struct Inflight {
    count: AtomicUsize,
    idle: (Mutex<()>, Condvar),
}

pub struct IoPool {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    inflight: Arc<Inflight>,
}

/// The pool refused a job (queue full, or shutting down).
#[derive(Debug, PartialEq, Eq)]
pub struct PoolBusy;

impl IoPool {
    pub fn new(threads: usize, name: &str) -> std::io::Result<Self> {
        let (tx, rx): (Sender<Job>, Receiver<Job>) = bounded(IO_QUEUE_DEPTH);
        let inflight = Arc::new(Inflight {
            count: AtomicUsize::new(0),
            idle: (Mutex::new(()), Condvar::new()),
        });
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let inflight = inflight.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || {
                        for job in rx {
                            // A panicking job must not kill the thread or leave the count
                            // (and every `drain`) stuck.
                            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err()
                            {
                                tracing::error!("an I/O job panicked");
                            }
                            if inflight.count.fetch_sub(1, Ordering::AcqRel) == 1 {
                                let _g = inflight.idle.0.lock();
                                inflight.idle.1.notify_all();
                            }
                        }
                    })?,
            );
        }
        Ok(Self {
            tx: Some(tx),
            threads: handles,
            inflight,
        })
    }

    /// Jobs queued or running.
    pub fn backlog(&self) -> usize {
        self.inflight.count.load(Ordering::Acquire)
    }

    /// Queues `job` if there is room; background work uses this and drops what is refused.
    pub fn try_spawn(&self, job: impl FnOnce() + Send + 'static) -> Result<(), PoolBusy> {
        let tx = self.tx.as_ref().ok_or(PoolBusy)?;
        self.inflight.count.fetch_add(1, Ordering::AcqRel);
        match tx.try_send(Box::new(job)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.inflight.count.fetch_sub(1, Ordering::AcqRel);
                Err(PoolBusy)
            }
        }
    }

    /// Runs `f` on the pool and waits for its result (waiting for queue room if needed).
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, PoolBusy> {
        let tx = self.tx.as_ref().ok_or(PoolBusy)?;
        let (rtx, rrx) = bounded(1);
        self.inflight.count.fetch_add(1, Ordering::AcqRel);
        let job: Job = Box::new(move || {
            let _ = rtx.send(f());
        });
        if tx.send(job).is_err() {
            self.inflight.count.fetch_sub(1, Ordering::AcqRel);
            return Err(PoolBusy);
        }
        rrx.recv().map_err(|_| PoolBusy)
    }

    /// Waits until every queued job has run.
    pub fn drain(&self) {
        let (lock, cv) = &self.inflight.idle;
        let mut g = lock.lock().unwrap_or_else(|p| p.into_inner());
        while self.inflight.count.load(Ordering::Acquire) != 0 {
            g = cv
                .wait_timeout(g, std::time::Duration::from_millis(10))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for IoPool {
    /// Runs what is queued, then stops the threads.
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_jobs_bounds_the_queue_and_drains() {
        let pool = IoPool::new(2, "t").unwrap();
        assert_eq!(pool.run(|| 6 * 7), Ok(42));
        let gate = Arc::new(std::sync::Barrier::new(3));
        for _ in 0..2 {
            let g = gate.clone();
            pool.try_spawn(move || {
                g.wait();
            })
            .unwrap();
        }
        // Both threads are parked at the barrier; fill the queue until it refuses.
        let mut queued = 0;
        while pool.try_spawn(|| {}).is_ok() {
            queued += 1;
            assert!(queued <= IO_QUEUE_DEPTH);
        }
        assert!(queued >= IO_QUEUE_DEPTH - 2);
        gate.wait();
        pool.drain();
        assert_eq!(pool.backlog(), 0);
    }
}
