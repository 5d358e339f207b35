//! One persistent thread pool for the matmuls: `threads − 1` workers plus the calling thread.
//!
//! Decode makes a couple of hundred small matmul calls per token, so a dispatch must cost about a
//! microsecond: workers poll an atomic for 2 ms after each job (spinning for the first 50 µs, then
//! yielding their CPU between polls) and only then sleep on a condition variable. A job is a
//! chunk counter that every participant (the caller included) pulls from, so a worker the OS has
//! descheduled simply takes no chunks. Measured dispatch overhead (bench `pool`): about 0.5-1 µs
//! per call on top of the work.
//!
//! Deadlock freedom: only one job runs at a time. A caller that finds the pool busy (another
//! thread is dispatching, or the call comes from inside a pool job) runs its chunks on its own
//! thread instead of waiting, so calls from rayon threads or from several threads at once always
//! make progress. The caller waits only for workers that actually joined its job, and they are
//! running chunks, never waiting on anything.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Environment variable overriding the thread count (a positive integer).
pub const THREADS_ENV: &str = "RIDGEFILL_THREADS";

/// How long an idle worker polls (spinning, then yielding) before it sleeps.
const SPIN: Duration = Duration::from_millis(2);
/// Of that, how long it spins without yielding the CPU.
const HOT_SPIN: Duration = Duration::from_micros(50);
/// How long the dispatcher spins for joined workers before it starts yielding its CPU (which
/// lets a worker that the OS preempted on a busy machine run again sooner).
const WAIT_SPIN: Duration = Duration::from_micros(20);

/// `state` layout: job epoch in the high 32 bits, "open" flag, then the count of workers inside.
const EPOCH_SHIFT: u32 = 32;
const OPEN: u64 = 1 << 31;
const ACTIVE_MASK: u64 = OPEN - 1;

/// The job the workers run: `f(chunk)` for chunks pulled from `next` until `n`.
struct Job {
    next: AtomicUsize,
    n: usize,
    /// Borrowed from the dispatching caller's stack; valid while the job is open or a worker
    /// that joined it is still inside (the caller waits for both to end).
    f: *const (dyn Fn(usize) + Sync),
}

struct Shared {
    state: AtomicU64,
    /// Written only by the thread holding `dispatch`, before it opens the job.
    job: std::cell::UnsafeCell<Job>,
    sleepers: AtomicUsize,
    /// Set when a worker's chunk panicked; the dispatcher re-raises it.
    panicked: AtomicBool,
    /// Set when the pool is dropped; workers exit.
    shutdown: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the dispatching thread while no worker can read it (the job
// is closed and no worker is inside, see `Pool::run`), and read by workers only between joining
// (a successful CAS on `state` that saw it open, Acquire) and leaving.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw closure pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// The pool. Get the process-wide one with [`Pool::global`].
pub struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    dispatch: Mutex<()>,
}

thread_local! {
    /// Set on pool workers and on a caller while it dispatches (nested calls run inline).
    static IN_POOL: Cell<bool> = const { Cell::new(false) };
}

impl Pool {
    /// The process-wide pool: [`THREADS_ENV`] threads if set, else the available parallelism.
    pub fn global() -> &'static Pool {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let env = std::env::var(THREADS_ENV)
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .filter(|&n| n > 0);
            let n = env.unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1)
            });
            Pool::new(n)
        })
    }

    /// A pool running jobs on `threads` threads (the caller and `threads − 1` workers).
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: std::cell::UnsafeCell::new(Job {
                next: AtomicUsize::new(0),
                n: 0,
                f: &|_| {},
            }),
            sleepers: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 1..threads {
            let s = shared.clone();
            // A worker that cannot be spawned only means fewer helpers; jobs still complete.
            let _ = std::thread::Builder::new()
                .name(format!("ridgefill-quant-{i}"))
                .spawn(move || worker(&s));
        }
        Pool {
            shared,
            threads,
            dispatch: Mutex::new(()),
        }
    }

    /// Threads a job can use (including the caller).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(i)` for every `i in 0..n`, spread over the pool; returns when all are done.
    ///
    /// Runs everything on the calling thread when `n < 2`, the pool has one thread, the pool is
    /// busy with another caller's job, or the call comes from inside a job.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let inline = |f: &(dyn Fn(usize) + Sync)| (0..n).for_each(f);
        if n < 2 || self.threads < 2 || IN_POOL.with(Cell::get) {
            return inline(f);
        }
        let Ok(_guard) = self.dispatch.try_lock() else {
            return inline(f);
        };
        let sh = &*self.shared;
        let state = sh.state.load(Ordering::Relaxed);
        debug_assert!(
            state & (OPEN | ACTIVE_MASK) == 0,
            "previous job not finished"
        );
        // SAFETY: we hold `dispatch`, the previous job is closed and no worker is inside it
        // (checked on exit of the previous `run`), so nobody reads `job` now.
        unsafe {
            let job = &mut *sh.job.get();
            job.next.store(0, Ordering::Relaxed);
            job.n = n;
            // Erase the borrow's lifetime: the job is closed and emptied before we return.
            job.f =
                std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static (dyn Fn(usize) + Sync)>(f);
        }
        let epoch = (state >> EPOCH_SHIFT).wrapping_add(1);
        // Open the job (SeqCst pairs with the sleepers check below, see `worker`).
        sh.state
            .store((epoch << EPOCH_SHIFT) | OPEN, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = sh.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            sh.wake.notify_all();
        }
        // Closes the job and waits for joined workers even if `f` panics on this thread, so no
        // worker can be left holding a pointer to a dead closure.
        struct Close<'a>(&'a Shared);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                IN_POOL.with(|c| c.set(false));
                let sh = self.0;
                let mut s = sh.state.fetch_and(!OPEN, Ordering::AcqRel) & !OPEN;
                let mut since: Option<Instant> = None;
                while s & ACTIVE_MASK != 0 {
                    if since.get_or_insert_with(Instant::now).elapsed() < WAIT_SPIN {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                    s = sh.state.load(Ordering::Acquire);
                }
            }
        }
        let close = Close(sh);
        IN_POOL.with(|c| c.set(true));
        // SAFETY: the job was published above and stays valid until `close` runs.
        unsafe { run_chunks(&*sh.job.get()) };
        drop(close);
        if sh.panicked.swap(false, Ordering::AcqRel) {
            panic!("ridgefill-quant: a pool worker panicked while running a job");
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let sh = &*self.shared;
        sh.shutdown.store(true, Ordering::SeqCst);
        let _l = sh.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
        sh.wake.notify_all();
    }
}

/// Pulls and runs chunks until none are left.
///
/// # Safety
/// `job.f` must point to a live closure.
unsafe fn run_chunks(job: &Job) {
    loop {
        let i = job.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.n {
            break;
        }
        // SAFETY: guaranteed by the caller.
        unsafe { (*job.f)(i) };
    }
}

fn worker(sh: &Shared) {
    IN_POOL.with(|c| c.set(true));
    let mut seen = sh.state.load(Ordering::Acquire) >> EPOCH_SHIFT;
    let mut idle_since = Instant::now();
    let mut spins = 0u32;
    loop {
        if sh.shutdown.load(Ordering::Relaxed) {
            return;
        }
        let s = sh.state.load(Ordering::Acquire);
        if s >> EPOCH_SHIFT != seen {
            if s & OPEN != 0 {
                // Join: counted in the low bits so the caller waits for us.
                if sh
                    .state
                    .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
                {
                    continue;
                }
                // SAFETY: we joined an open job, so `job` is published and stays valid until we
                // leave (the caller waits for the active count to drop to zero).
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
                    run_chunks(&*sh.job.get())
                }));
                if ran.is_err() {
                    sh.panicked.store(true, Ordering::Release);
                }
                sh.state.fetch_sub(1, Ordering::Release);
            }
            // Either done with it or it closed before we could join.
            seen = s >> EPOCH_SHIFT;
            idle_since = Instant::now();
            spins = 0;
            continue;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(64) {
            std::hint::spin_loop();
            continue;
        }
        let idle = idle_since.elapsed();
        if idle < HOT_SPIN {
            continue;
        }
        if idle < SPIN {
            // Still ready for the next job within microseconds, but not taking a CPU that
            // something else (the dispatcher's own work, another process) could use.
            std::thread::yield_now();
            continue;
        }
        // Sleep until the epoch changes. The SeqCst increment and re-check pair with the
        // dispatcher's SeqCst store and sleepers load, so a wake-up is never missed.
        let guard = sh.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
        sh.sleepers.fetch_add(1, Ordering::SeqCst);
        let mut guard = guard;
        while sh.state.load(Ordering::SeqCst) >> EPOCH_SHIFT == seen
            && !sh.shutdown.load(Ordering::SeqCst)
        {
            guard = sh.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        sh.sleepers.fetch_sub(1, Ordering::SeqCst);
        drop(guard);
        idle_since = Instant::now();
        spins = 0;
    }
}

/// Runs `f(i)` for `i in 0..n` on the global pool (see [`Pool::run`]).
pub fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    Pool::global().run(n, f)
}

/// Threads of the global pool.
pub fn threads() -> usize {
    Pool::global().threads()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_chunk_runs_once() {
        let pool = Pool::new(3);
        for n in [0, 1, 2, 5, 100, 1000] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    #[test]
    fn concurrent_and_nested_calls_finish() {
        let pool = Arc::new(Pool::new(2));
        let total = Arc::new(AtomicUsize::new(0));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (pool.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        pool.run(8, &|_| {
                            // A nested call runs inline instead of waiting for the pool.
                            pool.run(3, &|_| {
                                total.fetch_add(1, Ordering::Relaxed);
                            });
                        });
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(total.load(Ordering::Relaxed), 4 * 200 * 8 * 3);
    }

    #[test]
    fn workers_wake_after_sleeping() {
        let pool = Pool::new(2);
        std::thread::sleep(SPIN * 3);
        let hits = AtomicUsize::new(0);
        pool.run(64, &|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 64);
    }
}
