//! Every format's kernels, at every SIMD level this CPU has plus scalar, on both paths and with
//! and without the pool, against dequantise-then-f64 matmul.

mod common;

use common::*;
use ridgefill_quant::{GgmlType, MatmulConfig, MatmulPath, QWeight, SimdLevel};

/// Every configuration worth testing on this machine.
fn configs() -> Vec<MatmulConfig> {
    let mut out = Vec::new();
    for level in SimdLevel::available() {
        for path in [
            MatmulPath::Integer,
            MatmulPath::DequantGemm,
            MatmulPath::Auto,
            MatmulPath::Prompt,
        ] {
            for parallel in [false, true] {
                if path != MatmulPath::Integer && level != SimdLevel::Scalar {
                    // The GEMM path does not depend on the kernel level.
                    continue;
                }
                out.push(MatmulConfig {
                    level,
                    path,
                    parallel,
                });
            }
        }
    }
    out
}

fn run(w: &QWeight, cfg: &MatmulConfig, x: &[f32], m: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; m * w.rows()];
    w.matmul_with(cfg, x, m, &mut y).expect("sizes match");
    y
}

/// Checks `w` on `x` in every configuration, and the SIMD integer kernels against scalar.
fn check(what: &str, w: &QWeight, x: &[f32], m: usize) {
    let r = reference_stacked(w, x, m);
    let tol = r.tol();
    let scalar = MatmulConfig {
        level: SimdLevel::Scalar,
        path: MatmulPath::Integer,
        parallel: false,
    };
    let y_scalar = run(w, &scalar, x, m);
    for cfg in configs() {
        let y = run(w, &cfg, x, m);
        assert_close(&format!("{what} m={m} {cfg:?}"), &y, &r.y, &tol);
        if cfg.path == MatmulPath::Integer {
            // Same quantised activations, so only the f32 summation order may differ.
            let ys: Vec<f64> = y_scalar.iter().map(|&v| v as f64).collect();
            assert_close(
                &format!("{what} m={m} {cfg:?} vs scalar"),
                &y,
                &ys,
                &r.tol_same_ints(),
            );
        }
    }
}

#[test]
fn every_format_on_random_blocks() {
    eprintln!("SIMD levels tested: {:?}", SimdLevel::available());
    let mut rng = Rng::new(0x5EED_0001);
    for ty in TYPES {
        // 2 super-blocks for k-quants (512 columns); 77 columns exercise the float tail loop.
        let cols = match ty.block_size() {
            1 => 77,
            32 => 160,
            _ => 512,
        };
        for extreme in [false, true] {
            // 37 rows: nine 4-row passes and a remainder row.
            let w = stacked(&mut rng, &[ty], &[37], cols, extreme);
            // 6 and 17: groups of four activation rows plus single rows on the integer path.
            for m in [1, 3, 6, 17, 64] {
                let x = random_x(&mut rng, m, cols, extreme);
                check(&format!("{ty} extreme={extreme}"), &w, &x, m);
            }
        }
    }
}

#[test]
fn stacked_parts_of_different_types() {
    let mut rng = Rng::new(0x5EED_0002);
    // A Q4_K_M-style fused QKV (Q4_K, Q4_K, Q6_K), a legacy mix, and everything at once.
    let cases: [&[GgmlType]; 3] = [
        &[GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K],
        &[GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0],
        &TYPES,
    ];
    for types in cases {
        let rows: Vec<usize> = (0..types.len()).map(|i| 5 + 7 * i).collect();
        let w = stacked(&mut rng, types, &rows, 512, false);
        for m in [1, 3, 6, 17] {
            let x = random_x(&mut rng, m, 512, false);
            check(&format!("{types:?}"), &w, &x, m);
        }
    }
}

#[test]
fn big_enough_to_use_the_pool() {
    // 1000 × 512 rows cross the parallel threshold and cut into many chunks over two parts.
    let mut rng = Rng::new(0x5EED_0003);
    let w = stacked(
        &mut rng,
        &[GgmlType::Q4_1, GgmlType::Q6_K],
        &[600, 400],
        512,
        false,
    );
    for m in [1, 5] {
        let x = random_x(&mut rng, m, 512, false);
        check("pool", &w, &x, m);
    }
}

#[test]
fn row_lane_layout_gives_the_same_products() {
    // Either level packs the same layout; the calls below run both levels' kernels where present.
    let Some(pack) = [SimdLevel::AvxVnni, SimdLevel::Avx512Vnni]
        .into_iter()
        .find(|l| l.is_available())
    else {
        eprintln!("neither AVX-VNNI nor AVX-512 VNNI: the row-lane layout is never used here");
        return;
    };
    let mut rng = Rng::new(0x5EED_0007);
    // One tile, many tiles over the pool, and stacked parts of mixed layouts (Q5_0 stays rows).
    let cases: [(&[GgmlType], &[usize]); 4] = [
        (&[GgmlType::Q4_0], &[16]),
        (&[GgmlType::Q4_1], &[1024]),
        (&[GgmlType::Q8_0], &[48]),
        (
            &[GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0],
            &[32, 37, 64],
        ),
    ];
    for (types, rows) in cases {
        for extreme in [false, true] {
            let w = stacked(&mut rng, types, rows, 160, extreme);
            let lanes = w.clone().prepared_for(pack);
            for (p, q) in w.parts().iter().zip(lanes.parts()) {
                let want = matches!(p.ty(), GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0);
                assert_eq!(q.is_row_lanes(), want, "{types:?}: {} rearranged", p.ty());
            }
            // The same bytes: dequantised bit for bit, whatever the layout.
            assert_eq!(w.dequantize(), lanes.dequantize(), "{types:?}");
            // The row layout's AVX2 kernels: the same quantised integers.
            let integer = MatmulConfig {
                level: SimdLevel::Avx2,
                path: MatmulPath::Integer,
                parallel: false,
            };
            // 1..=9 and 17: every activation group (8, 4, 2, 1) and their remainders.
            for m in [1, 2, 3, 4, 5, 7, 8, 9, 17] {
                let x = random_x(&mut rng, m, 160, extreme);
                let r = reference_stacked(&w, &x, m);
                let y_rows: Vec<f64> = run(&w, &integer, &x, m).iter().map(|&v| v as f64).collect();
                for cfg in configs() {
                    let what = format!("{types:?} extreme={extreme} m={m} {cfg:?}");
                    let y = run(&lanes, &cfg, &x, m);
                    assert_close(&what, &y, &r.y, &r.tol());
                    if cfg.path == MatmulPath::Integer {
                        // Same integers as the row layout's kernels: only the f32 sums differ.
                        assert_close(&what, &y, &y_rows, &r.tol_same_ints());
                    }
                }
            }
        }
    }
}

#[test]
fn prompt_rows_round_alike_in_any_batch() {
    // A follow-up turn's few rows must round as they would inside a cold prefill's chunk.
    let mut rng = Rng::new(0x5EED_0008);
    let cols = 160;
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
    ] {
        let cols = if ty.block_size() == 32 { cols } else { 512 };
        let w = stacked(&mut rng, &[ty], &[48], cols, false);
        let big = 64;
        let x = random_x(&mut rng, big, cols, false);
        let prompt = MatmulConfig {
            path: MatmulPath::Prompt,
            ..MatmulConfig::default()
        };
        let whole = run(&w, &prompt, &x, big);
        for m in [1, 8, 19] {
            let rows = &x[(big - m) * cols..];
            let few = run(&w, &prompt, rows, m);
            let want: Vec<f64> = whole[(big - m) * w.rows()..]
                .iter()
                .map(|&v| v as f64)
                .collect();
            // f32 GEMM rounding only (the 8-bit path is ~1e-2 of the scale off).
            let scale = want.iter().fold(0.0f64, |a, v| a.max(v.abs()));
            let tol = vec![1e-5 * scale; want.len()];
            assert_close(&format!("{ty} last {m} of {big} rows"), &few, &want, &tol);
        }
    }
}

#[test]
fn dequantize_rows_into_spans_parts() {
    let mut rng = Rng::new(0x5EED_0004);
    let w = stacked(
        &mut rng,
        &[GgmlType::Q4_0, GgmlType::F16],
        &[3, 4],
        64,
        false,
    );
    let all = w.dequantize();
    let mut some = vec![0f32; 3 * 64];
    w.dequantize_rows_into(2, &mut some).unwrap();
    assert_eq!(&some[..], &all[2 * 64..5 * 64]);
}

#[test]
fn concurrent_and_nested_matmuls_agree_with_serial() {
    // Several threads share one weight and the global pool (only one dispatches at a time, the
    // others run inline), and matmuls issued from inside pool jobs run inline too: nothing may
    // deadlock and every result must equal the single-threaded one. Bit-equal, because each
    // output row is summed in the same order whichever thread and row group computes it.
    let mut rng = Rng::new(0x5EED_0005);
    let w = std::sync::Arc::new(stacked(
        &mut rng,
        &[GgmlType::Q4_1, GgmlType::Q4_K],
        &[300, 200],
        512,
        false,
    ));
    let x = std::sync::Arc::new(random_x(&mut rng, 2, 512, false));
    let serial = MatmulConfig {
        parallel: false,
        ..MatmulConfig::default()
    };
    let want = run(&w, &serial, &x, 2);
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let (w, x, want) = (w.clone(), x.clone(), want.clone());
            std::thread::spawn(move || {
                for _ in 0..50 {
                    let mut y = vec![0f32; 2 * w.rows()];
                    w.matmul(&x, 2, &mut y).unwrap();
                    assert_eq!(y, want);
                }
            })
        })
        .collect();
    let nested_ok = std::sync::atomic::AtomicUsize::new(0);
    ridgefill_quant::pool::for_each(8, &|_| {
        let mut y = vec![0f32; 2 * w.rows()];
        w.matmul(&x, 2, &mut y).unwrap();
        if y == want {
            nested_ok.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    assert_eq!(nested_ok.load(std::sync::atomic::Ordering::Relaxed), 8);
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn dequantize_is_bit_identical_to_ridgefill_io() {
    // The GEMM path's dequantisers (SIMD where available) must reproduce ridgefill-io's
    // reference dequantisation exactly, bit for bit.
    let mut rng = Rng::new(0x5EED_0006);
    for ty in TYPES {
        for extreme in [false, true] {
            let (rows, cols) = (3, if ty.block_size() == 1 { 77 } else { 512 });
            let raw = random_weight(&mut rng, ty, rows, cols, extreme);
            let want = ridgefill_io::quant::dequantize(ty, &raw, rows * cols).unwrap();
            let got = QWeight::from(matrix(ty, rows, cols, raw)).dequantize();
            let same = want
                .iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{ty} extreme={extreme}: dequantisation differs from ridgefill-io"
            );
        }
    }
}

#[test]
fn matmuls_from_rayon_threads_finish() {
    use rayon::prelude::*;
    let mut rng = Rng::new(0x5EED_0007);
    let w = stacked(
        &mut rng,
        &[GgmlType::Q8_0, GgmlType::Q6_K],
        &[400, 300],
        512,
        false,
    );
    let x = random_x(&mut rng, 1, 512, false);
    let serial = MatmulConfig {
        parallel: false,
        ..MatmulConfig::default()
    };
    let want = run(&w, &serial, &x, 1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let ok = pool.install(|| {
        (0..64)
            .into_par_iter()
            .map(|_| {
                let mut y = vec![0f32; w.rows()];
                w.matmul(&x, 1, &mut y).unwrap();
                y == want
            })
            .filter(|&same| same)
            .count()
    });
    assert_eq!(ok, 64);
}
