//! Kernel timings, measured side by side (alternating rounds, medians) so the ratios hold on a
//! shared machine.
//!
//! `cargo bench -p ridgefill-quant --bench gemv -- [formats|smollm|pool|threshold|decode|all]`
//!
//! - `formats`: GEMV (m = 1) per storage type on a 3072 × 1536 weight, against the `gemm`
//!   crate's f32 GEMV of the same shape; weights rotate through copies totalling ≥ 64 MiB so they
//!   stream from memory as in decode. Reports GB/s of weight bytes.
//! - `smollm`: the SmolLM2-135M shapes with its real tensors (fused QKV, o, fused gate/up, down,
//!   the tied Q8_0 head) against f32 GEMV of the same shapes.
//! - `pool`: per-call cost of a pool dispatch, and a small matmul inline vs on the pool.
//! - `threshold`: integer kernels vs dequantise + f32 GEMM over m, per type.
//! - `decode`: one decode step worth of SmolLM2 matmuls (30 × 4 + head), pool vs one thread.
//!
//! The real-model modes read the models `ridgefill fetch` put in models/cache (or
//! `$RIDGEFILL_CACHE`).

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use ridgefill_io::GgufFile;
use ridgefill_quant::{
    GgmlType, MatmulConfig, MatmulPath, QMatrix, QWeight, SimdLevel, WeightBytes, pool,
};

/// Rounds of the alternating measurement.
const ROUNDS: usize = 15;

/// Seconds of CPU time this thread has used.
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Per-call medians of one function: wall seconds, and CPU seconds of the calling thread (equal
/// to wall on an idle machine for single-threaded work; on a shared machine it leaves out the time
/// the thread was descheduled).
#[derive(Clone, Copy, Debug)]
struct Timing {
    wall: f64,
    cpu: f64,
    /// The fastest round's wall time per call: on a shared machine, the closest to what an idle
    /// machine gives (rounds where no other process took our CPUs).
    best: f64,
}

/// Times each function in alternating rounds of about `round` each; medians over the rounds.
fn race(round: Duration, fs: &mut [&mut dyn FnMut()]) -> Vec<Timing> {
    race_n(round, ROUNDS, fs)
}

/// [`race`] with `rounds` rounds.
fn race_n(round: Duration, rounds: usize, fs: &mut [&mut dyn FnMut()]) -> Vec<Timing> {
    // Calibrate calls per round, warming every function.
    let mut reps = Vec::new();
    for f in fs.iter_mut() {
        f();
        let t = Instant::now();
        let mut n = 0u64;
        while t.elapsed() < round / 4 {
            f();
            n += 1;
        }
        reps.push(((n * 4) as usize).max(1));
    }
    let mut wall: Vec<Vec<f64>> = vec![Vec::new(); fs.len()];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); fs.len()];
    for _ in 0..rounds {
        for (i, f) in fs.iter_mut().enumerate() {
            let (t, c) = (Instant::now(), thread_cpu());
            for _ in 0..reps[i] {
                f();
            }
            cpu[i].push((thread_cpu() - c) / reps[i] as f64);
            wall[i].push(t.elapsed().as_secs_f64() / reps[i] as f64);
        }
    }
    let median = |mut t: Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    wall.into_iter()
        .zip(cpu)
        .map(|(w, c)| Timing {
            best: w.iter().copied().fold(f64::INFINITY, f64::min),
            wall: median(w),
            cpu: median(c),
        })
        .collect()
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn sym(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random valid bytes for `rows × cols` of `ty` (scales small and finite).
fn random_bytes(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols / ty.block_size() * ty.type_size();
    let mut raw: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
    let put = |raw: &mut [u8], at: usize, v: f32| {
        raw[at..at + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())
    };
    let ts = ty.type_size();
    match ty {
        GgmlType::F32 => {
            for c in raw.chunks_exact_mut(4) {
                c.copy_from_slice(&(0.05 * rng.sym()).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in raw.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(0.05 * rng.sym()).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in raw.chunks_exact_mut(2) {
                c.copy_from_slice(&bf16::from_f32(0.05 * rng.sym()).to_bits().to_le_bytes());
            }
        }
        GgmlType::Q6_K => {
            for b in raw.chunks_exact_mut(ts) {
                put(b, 208, 0.001);
            }
        }
        _ => {
            for b in raw.chunks_exact_mut(ts) {
                put(b, 0, 0.01);
                if matches!(
                    ty,
                    GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K
                ) {
                    put(b, 2, -0.05);
                }
            }
        }
    }
    raw
}

fn qmatrix(ty: GgmlType, rows: usize, cols: usize, raw: Vec<u8>) -> QWeight {
    QWeight::from(QMatrix::new(ty, rows, cols, WeightBytes::from_vec(raw)).unwrap())
}

/// f32 GEMV through the gemm crate: `y[rows] = W[rows, cols]·x`, W row-major.
fn gemm_gemv(w: &[f32], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) {
    assert!(w.len() == rows * cols && x.len() == cols && y.len() == rows);
    // SAFETY: extents asserted above; rhs[k, j] = w[j·cols + k].
    unsafe {
        gemm::gemm(
            1,
            rows,
            cols,
            y.as_mut_ptr(),
            1,
            rows as isize,
            false,
            x.as_ptr(),
            1,
            cols as isize,
            w.as_ptr(),
            cols as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

fn cfg(parallel: bool, path: MatmulPath) -> MatmulConfig {
    MatmulConfig {
        parallel,
        path,
        ..MatmulConfig::default()
    }
}

const TYPES: [GgmlType; 11] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

fn formats() {
    let (rows, cols) = (3072, 1536);
    let mut rng = Rng(1);
    let x: Vec<f32> = (0..cols).map(|_| rng.sym()).collect();
    let mut y = vec![0f32; rows];
    let mut y1 = vec![0f32; rows];
    let mut y2 = vec![0f32; rows];
    // f32 reference: copies totalling ≥ 64 MiB, rotated.
    let f32_bytes = rows * cols * 4;
    let n_f = (64usize << 20).div_ceil(f32_bytes);
    let dense: Vec<Vec<f32>> = (0..n_f)
        .map(|_| (0..rows * cols).map(|_| 0.05 * rng.sym()).collect())
        .collect();
    println!(
        "GEMV m=1, W {rows}x{cols}, weights rotated over >= 64 MiB of copies; one thread (CPU time) and pool of {} (wall); f32 = gemm crate, one thread (CPU time)",
        pool::threads()
    );
    println!(
        "{:6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "type", "bytes", "us 1t cpu", "GB/s 1t", "us pool", "GB/s pl", "f32 us", "f32/q 1t"
    );
    for ty in TYPES {
        let bytes = rows * cols / ty.block_size() * ty.type_size();
        let n = (64usize << 20).div_ceil(bytes);
        let ws: Vec<QWeight> = (0..n)
            .map(|_| qmatrix(ty, rows, cols, random_bytes(&mut rng, ty, rows, cols)))
            .collect();
        let (mut i, mut j, mut k) = (0, 0, 0);
        let one = cfg(false, MatmulPath::Integer);
        let par = cfg(true, MatmulPath::Integer);
        let t = race(
            Duration::from_millis(40),
            &mut [
                &mut || {
                    i = (i + 1) % n;
                    ws[i].matmul_with(&one, &x, 1, &mut y).unwrap();
                },
                &mut || {
                    j = (j + 1) % n;
                    ws[j].matmul_with(&par, &x, 1, &mut y1).unwrap();
                },
                &mut || {
                    k = (k + 1) % n_f;
                    gemm_gemv(&dense[k], rows, cols, &x, &mut y2);
                },
            ],
        );
        let gbs = |s: f64| bytes as f64 / s / 1e9;
        println!(
            "{:6} {:>9} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2}",
            ty.name(),
            bytes,
            t[0].cpu * 1e6,
            gbs(t[0].cpu),
            t[1].wall * 1e6,
            gbs(t[1].wall),
            t[2].cpu * 1e6,
            t[2].cpu / t[0].cpu
        );
        black_box(&y);
    }
}

/// In-cache kernel speed: 64 × 1536 weights (≤ 400 KB, L2-resident), one thread, CPU time,
/// every type in the same alternating rounds (so their ratios hold on a busy machine).
fn compute() {
    let (rows, cols) = (64, 1536);
    let mut rng = Rng(6);
    let x: Vec<f32> = (0..cols).map(|_| rng.sym()).collect();
    println!("in-cache GEMV {rows}x{cols}, one thread, CPU time: G weights/s (ns per 32 weights)");
    let ws: Vec<QWeight> = TYPES
        .iter()
        .map(|&ty| qmatrix(ty, rows, cols, random_bytes(&mut rng, ty, rows, cols)))
        .collect();
    let mut ys = vec![vec![0f32; rows]; ws.len()];
    let one = cfg(false, MatmulPath::Integer);
    let mut fs: Vec<Box<dyn FnMut() + '_>> = ws
        .iter()
        .zip(ys.iter_mut())
        .map(|(w, y)| {
            let x = &x;
            Box::new(move || w.matmul_with(&one, x, 1, y).unwrap()) as Box<dyn FnMut()>
        })
        .collect();
    let mut refs: Vec<&mut dyn FnMut()> = fs
        .iter_mut()
        .map(|f| &mut **f as &mut dyn FnMut())
        .collect();
    let t = race(Duration::from_millis(20), &mut refs);
    let n = (rows * cols) as f64;
    for (ty, t) in TYPES.iter().zip(t) {
        println!(
            "{:6} {:>6.1} G/s ({:.2} ns per 32)",
            ty.name(),
            n / t.cpu / 1e9,
            t.cpu / n * 32.0 * 1e9
        );
    }
}

/// Dequantisation speed (the GEMM path's fixed cost): 64 rows × 1536 at a time, one thread.
fn dequant() {
    let (rows, cols) = (64, 1536);
    let mut rng = Rng(7);
    println!("dequantize_rows_into, {rows}x{cols}, one thread, CPU time: ns per weight");
    let ws: Vec<QWeight> = TYPES
        .iter()
        .map(|&ty| qmatrix(ty, rows, cols, random_bytes(&mut rng, ty, rows, cols)))
        .collect();
    let mut outs = vec![vec![0f32; rows * cols]; ws.len()];
    let mut fs: Vec<Box<dyn FnMut() + '_>> = ws
        .iter()
        .zip(outs.iter_mut())
        .map(|(w, o)| Box::new(move || w.dequantize_rows_into(0, o).unwrap()) as Box<dyn FnMut()>)
        .collect();
    let mut refs: Vec<&mut dyn FnMut()> = fs
        .iter_mut()
        .map(|f| &mut **f as &mut dyn FnMut())
        .collect();
    let t = race(Duration::from_millis(20), &mut refs);
    for (ty, t) in TYPES.iter().zip(t) {
        println!(
            "{:6} {:.3} ns",
            ty.name(),
            t.cpu / (rows * cols) as f64 * 1e9
        );
    }
}

fn smollm_file() -> Option<Arc<GgufFile>> {
    let path = ridgefill_testkit::models_dir().join("smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf");
    match GgufFile::open(&path) {
        Ok(f) => Some(Arc::new(f)),
        Err(e) => {
            println!("skipped: {}: {e}", path.display());
            None
        }
    }
}

/// SmolLM2's per-layer weights: fused QKV, o, fused gate/up, down.
fn layer(file: &Arc<GgufFile>, l: usize) -> [QWeight; 4] {
    let m = |s: &str| QMatrix::from_gguf(file, &format!("blk.{l}.{s}.weight")).unwrap();
    [
        QWeight::new(vec![m("attn_q"), m("attn_k"), m("attn_v")]).unwrap(),
        QWeight::from(m("attn_output")),
        QWeight::new(vec![m("ffn_gate"), m("ffn_up")]).unwrap(),
        QWeight::from(m("ffn_down")),
    ]
}

fn smollm() {
    let Some(file) = smollm_file() else { return };
    let head = QWeight::from(QMatrix::from_gguf(&file, "token_embd.weight").unwrap());
    let [qkv, o, gate_up, down] = layer(&file, 0);
    let mut rng = Rng(2);
    println!(
        "SmolLM2-135M real tensors, GEMV m=1 (layer 0; warm in cache except the head); one thread (CPU time), pool (wall); f32 = gemm crate GEMV on the dequantised weight, one thread (CPU time)"
    );
    println!(
        "{:8} {:>6} {:>6} {:6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7}",
        "weight",
        "in",
        "out",
        "type",
        "MB",
        "us 1t cpu",
        "GB/s 1t",
        "us pool",
        "GB/s pl",
        "f32 us 1t",
        "f32/q"
    );
    for (name, w) in [
        ("qkv", &qkv),
        ("o", &o),
        ("gate_up", &gate_up),
        ("down", &down),
        ("head", &head),
    ] {
        let x: Vec<f32> = (0..w.cols()).map(|_| rng.sym()).collect();
        let dense = w.dequantize();
        let lanes = w.clone().prepared_for(SimdLevel::detect());
        let mut y = vec![0f32; w.rows()];
        let mut y1 = vec![0f32; w.rows()];
        let mut y2 = vec![0f32; w.rows()];
        let mut y3 = vec![0f32; w.rows()];
        let one = cfg(false, MatmulPath::Integer);
        let par = cfg(true, MatmulPath::Integer);
        let t = race(
            Duration::from_millis(40),
            &mut [
                &mut || w.matmul_with(&one, &x, 1, &mut y).unwrap(),
                &mut || w.matmul_with(&par, &x, 1, &mut y1).unwrap(),
                &mut || gemm_gemv(&dense, w.rows(), w.cols(), &x, &mut y2),
                &mut || lanes.matmul_with(&one, &x, 1, &mut y3).unwrap(),
            ],
        );
        println!(
            "{name}: prepared (row lanes {}) us 1t cpu {:.1}",
            lanes.parts()[0].is_row_lanes(),
            t[3].cpu * 1e6
        );
        let gbs = |s: f64| w.bytes() as f64 / s / 1e9;
        let types: Vec<&str> = w.parts().iter().map(|p| p.ty().name()).collect();
        println!(
            "{:8} {:>6} {:>6} {:6} {:>9.2} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7.2}",
            name,
            w.cols(),
            w.rows(),
            types[0],
            w.bytes() as f64 / 1e6,
            t[0].cpu * 1e6,
            gbs(t[0].cpu),
            t[1].wall * 1e6,
            gbs(t[1].wall),
            t[2].cpu * 1e6,
            t[2].cpu / t[0].cpu,
        );
    }
}

fn pool_overhead() {
    let threads = pool::threads();
    println!("pool: {threads} threads (wall times)");
    let busy = |us: u64| {
        let t = Instant::now();
        while t.elapsed() < Duration::from_micros(us) {
            std::hint::spin_loop();
        }
    };
    // A job of `threads` chunks of 5 us each: ideally 5 us on the pool, threads × 5 us inline.
    // The pool's per-call overhead is the excess over 5 us. Measured back to back (workers
    // spinning) and with 20 us of caller-side work between calls, as in decode where norms and
    // attention run between matmuls.
    let chunk = |_: usize| busy(5);
    let t = race_n(
        Duration::from_millis(5),
        200,
        &mut [
            &mut || (0..threads).for_each(chunk),
            &mut || pool::for_each(threads, &chunk),
            &mut || busy(20),
            &mut || {
                busy(20);
                pool::for_each(threads, &chunk)
            },
            &mut || {
                pool::for_each(threads, &|_| {
                    black_box(0);
                })
            },
        ],
    );
    for (what, f) in [
        ("median", (|t: &Timing| t.wall) as fn(&Timing) -> f64),
        ("best round", |t: &Timing| t.best),
    ] {
        println!(
            "{what}: job of {threads} x 5 us chunks: inline {:.2} us; pool back to back {:.2} us (overhead {:.2} us); after 20 us of other work {:.2} us (overhead {:.2} us); empty job {:.3} us",
            f(&t[0]) * 1e6,
            f(&t[1]) * 1e6,
            (f(&t[1]) - 5e-6) * 1e6,
            (f(&t[3]) - f(&t[2])) * 1e6,
            (f(&t[3]) - f(&t[2]) - 5e-6) * 1e6,
            f(&t[4]) * 1e6,
        );
    }
    let mut rng = Rng(3);
    for (rows, cols) in [(64, 576), (192, 576), (576, 576), (1536, 576)] {
        let w = qmatrix(
            GgmlType::Q4_1,
            rows,
            cols,
            random_bytes(&mut rng, GgmlType::Q4_1, rows, cols),
        );
        let x: Vec<f32> = (0..cols).map(|_| rng.sym()).collect();
        let mut y = vec![0f32; rows];
        let mut y1 = vec![0f32; rows];
        let t = race_n(
            Duration::from_millis(5),
            200,
            &mut [
                &mut || {
                    w.matmul_with(&cfg(false, MatmulPath::Integer), &x, 1, &mut y)
                        .unwrap()
                },
                &mut || {
                    w.matmul_with(&cfg(true, MatmulPath::Integer), &x, 1, &mut y1)
                        .unwrap()
                },
            ],
        );
        println!(
            "Q4_1 {rows}x{cols} GEMV, median (best round) wall: one thread {:.2} ({:.2}) us, pool {:.2} ({:.2}) us",
            t[0].wall * 1e6,
            t[0].best * 1e6,
            t[1].wall * 1e6,
            t[1].best * 1e6
        );
    }
}

fn threshold() {
    let mut rng = Rng(4);
    let ms = [1usize, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512];
    println!(
        "integer kernels / dequantise + f32 GEMM, one thread, ms of CPU time per call, W 1536x1536"
    );
    print!("{:6}", "type");
    for m in ms {
        print!(" {:>11}", format!("m={m}"));
    }
    println!("   (int/gemm)");
    for ty in TYPES {
        let (rows, cols) = (1536, 1536);
        let w = qmatrix(ty, rows, cols, random_bytes(&mut rng, ty, rows, cols));
        print!("{:6}", ty.name());
        let mut cross = None;
        for m in ms {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.sym()).collect();
            let mut y = vec![0f32; m * rows];
            let mut y1 = vec![0f32; m * rows];
            let t = race(
                Duration::from_millis(if m > 64 { 60 } else { 20 }),
                &mut [
                    &mut || {
                        w.matmul_with(&cfg(false, MatmulPath::Integer), &x, m, &mut y)
                            .unwrap()
                    },
                    &mut || {
                        w.matmul_with(&cfg(false, MatmulPath::DequantGemm), &x, m, &mut y1)
                            .unwrap()
                    },
                ],
            );
            if cross.is_none() && t[1].cpu < t[0].cpu {
                cross = Some(m);
            }
            print!(" {:>5.2}/{:<5.2}", t[0].cpu * 1e3, t[1].cpu * 1e3);
        }
        println!(
            "  gemm faster from m = {}",
            cross.map_or("-".into(), |m| m.to_string())
        );
    }
}

fn decode() {
    let Some(file) = smollm_file() else { return };
    let layers: Vec<[QWeight; 4]> = (0..30).map(|l| layer(&file, l)).collect();
    let head = QWeight::from(QMatrix::from_gguf(&file, "token_embd.weight").unwrap());
    let bytes: usize = layers.iter().flatten().map(QWeight::bytes).sum::<usize>() + head.bytes();
    let par = MatmulConfig::default();
    let one = cfg(false, MatmulPath::Auto);
    // Many rounds of one step each, so some fall in moments the machine is quiet.
    let t = race_n(
        Duration::from_millis(1),
        300,
        &mut [&mut || step_alone(&layers, &head, &par), &mut || {
            step_alone(&layers, &head, &one)
        }],
    );
    println!(
        "SmolLM2-135M decode step worth of matmuls (30 x [qkv, o, gate_up, down] + Q8_0 head, 121 calls, {:.1} MB of weights):",
        bytes as f64 / 1e6
    );
    println!(
        "  pool ({} threads): median {:.0} us, best round {:.0} us ({:.1} GB/s)",
        pool::threads(),
        t[0].wall * 1e6,
        t[0].best * 1e6,
        bytes as f64 / t[0].best / 1e9,
    );
    println!(
        "  one thread: median {:.0} us wall, {:.0} us CPU time ({:.1} GB/s), best round {:.0} us wall",
        t[1].wall * 1e6,
        t[1].cpu * 1e6,
        bytes as f64 / t[1].cpu / 1e9,
        t[1].best * 1e6
    );
    println!(
        "  (llama.cpp decodes a whole SmolLM2-135M Q4_1 token in about 6900 us on 2 threads here)"
    );
}

fn step_alone(layers: &[[QWeight; 4]], head: &QWeight, c: &MatmulConfig) {
    thread_local! {
        static Y: std::cell::RefCell<Vec<f32>> = std::cell::RefCell::new(vec![0f32; 49152]);
    }
    // Activations as a normed hidden state would be (values do not change the work).
    let x: Vec<f32> = (0..1536)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    Y.with(|y| {
        let mut y = y.borrow_mut();
        for l in layers {
            for w in l {
                w.matmul_with(c, &x[..w.cols()], 1, &mut y[..w.rows()])
                    .unwrap();
            }
        }
        head.matmul_with(c, &x[..576], 1, &mut y[..]).unwrap();
    });
}

/// The head from the mapping vs the same bytes copied to the heap.
fn mmap_vs_heap() {
    let Some(file) = smollm_file() else { return };
    let mapped = QMatrix::from_gguf(&file, "token_embd.weight").unwrap();
    let heap = QWeight::from(
        QMatrix::new(
            mapped.ty(),
            mapped.rows(),
            mapped.cols(),
            WeightBytes::from_vec(mapped.raw().to_vec()),
        )
        .unwrap(),
    );
    let mapped = QWeight::from(mapped);
    let x: Vec<f32> = (0..576).map(|i| (i as f32).sin()).collect();
    let (mut y, mut y1) = (vec![0f32; 49152], vec![0f32; 49152]);
    let one = cfg(false, MatmulPath::Integer);
    let t = race(
        Duration::from_millis(100),
        &mut [
            &mut || mapped.matmul_with(&one, &x, 1, &mut y).unwrap(),
            &mut || heap.matmul_with(&one, &x, 1, &mut y1).unwrap(),
        ],
    );
    println!(
        "head Q8_0 one thread: mapped {:.0} us ({:.1} GB/s), heap copy {:.0} us ({:.1} GB/s)",
        t[0].cpu * 1e6,
        mapped.bytes() as f64 / t[0].cpu / 1e9,
        t[1].cpu * 1e6,
        heap.bytes() as f64 / t[1].cpu / 1e9
    );
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let all = args.is_empty() || args.iter().any(|a| a == "all");
    let want = |s: &str| all || args.iter().any(|a| a == s);
    println!("SIMD level: {:?}", ridgefill_quant::SimdLevel::detect());
    if want("dequant") {
        dequant();
    }
    if want("compute") {
        compute();
    }
    if want("mmap") {
        mmap_vs_heap();
    }
    if want("pool") {
        pool_overhead();
    }
    if want("smollm") {
        smollm();
    }
    if want("formats") {
        formats();
    }
    if want("decode") {
        decode();
    }
    if want("threshold") {
        threshold();
    }
}
