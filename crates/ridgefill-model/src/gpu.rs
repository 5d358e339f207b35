//! The packed-weight matmul on GPU backends (wgpu, cuda): one cubecl kernel, written by hand
//! because burn's quantised matmul has no scheme with a per-block min and dequantises per call
//! where it falls back (see `packed.rs`).
//!
//! A cube holds `ROWS_PER_CUBE` output features, one row of `WIDTH` units each; the units of a
//! row take turns at its packed words (so neighbouring units read neighbouring words), decode
//! each word's codes, and accumulate `scale · Σ q·x + min · Σ x` for up to `TILE_ROWS` activation
//! rows at once, so a weight word is read once per tile rather than once per activation row.
//! The partial sums meet in shared memory.

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, FloatDType, Int, Shape, Tensor};
use burn_cubecl::CubeBackend;
use burn_cubecl::cubecl::{CubeCount, CubeDim};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;

/// Units sharing one output feature (a warp / subgroup on most GPUs).
const WIDTH: u32 = 32;
/// Output features per cube.
const ROWS_PER_CUBE: u32 = 8;
/// Activation rows one pass over the weight serves (accumulators per unit).
const TILE_ROWS: usize = 8;

/// Output spec of [`PackedOps::packed_matmul`]: `[m, rows]` f32.
fn packed_meta(
    x: &TensorSpec,
    _words: &TensorSpec,
    _scales: &TensorSpec,
    _mins: &TensorSpec,
    rows: &usize,
    _bits: &u32,
    _group: &u32,
) -> TensorSpec {
    TensorSpec::new(Shape::new([x.shape[0], *rows]), DType::F32)
}

/// The backend operation behind [`packed_matmul`].
#[backend_extension(Cube, Fusion)]
pub trait PackedOps: Backend {
    /// `x · Wᵀ` for packed `W` (`[rows, k]` codes, see `crate::packed::PackedWeight`).
    #[fusion(meta = packed_meta)]
    fn packed_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        scales: &FloatTensor<Self>,
        mins: &FloatTensor<Self>,
        rows: usize,
        bits: u32,
        group: u32,
    ) -> FloatTensor<Self>;
}

impl PackedOps for CubeBackend {
    fn packed_matmul(
        x: FloatTensor<Self>,
        words: IntTensor<Self>,
        scales: &FloatTensor<Self>,
        mins: &FloatTensor<Self>,
        rows: usize,
        bits: u32,
        group: u32,
    ) -> FloatTensor<Self> {
        let x: CubeTensor = into_contiguous(x);
        let m = x.meta.shape()[0];
        let shape = Shape::new([m, rows]);
        let buffer = x.client.empty(shape.num_elements() * size_of::<f32>());
        let out = CubeTensor::new_contiguous(
            x.client.clone(),
            x.device.clone(),
            shape,
            buffer,
            DType::F32,
        );
        let tile = m.min(TILE_ROWS).next_power_of_two();
        let count = CubeCount::Static(
            (rows as u32).div_ceil(ROWS_PER_CUBE),
            m.div_ceil(tile) as u32,
            1,
        );
        kernel::packed_matmul_kernel::launch(
            &out.client,
            count,
            CubeDim::new_2d(WIDTH, ROWS_PER_CUBE),
            x.into_tensor_arg(),
            into_contiguous(words).into_tensor_arg(),
            into_contiguous(scales.clone()).into_tensor_arg(),
            into_contiguous(mins.clone()).into_tensor_arg(),
            out.clone().into_tensor_arg(),
            bits,
            group,
            tile as u32,
        );
        out
    }
}

mod kernel {
    use burn_cubecl::cubecl;
    use burn_cubecl::cubecl::prelude::*;

    use super::{ROWS_PER_CUBE, WIDTH};

    /// # Shapes
    /// - x: `[m, k]`, words: `[rows · k · bits / 32]`, scales, mins: `[rows · k / group]`
    /// - out: `[m, rows]`
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn packed_matmul_kernel(
        x: &Tensor<f32>,
        words: &Tensor<u32>,
        scales: &Tensor<f32>,
        mins: &Tensor<f32>,
        out: &mut Tensor<f32>,
        #[comptime] bits: u32,
        #[comptime] group: u32,
        #[comptime] tile: u32,
    ) {
        let m = x.shape(0);
        let k = x.shape(1);
        let rows = out.shape(1);
        let per_word = comptime!((32 / bits) as usize);
        let words_per_group = comptime!((group * bits / 32) as usize);
        let mask = comptime!((1u32 << bits) - 1);
        let tile_n = comptime!(tile as usize);
        let row = (CUBE_POS_X * ROWS_PER_CUBE + UNIT_POS_Y) as usize;
        let m0 = CUBE_POS_Y as usize * tile_n;
        let words_per_row = k / per_word;

        let mut acc = Array::<f32>::new(tile_n);
        #[unroll]
        for i in 0..tile_n {
            acc[i] = 0.0;
        }
        if row < rows {
            let mut w = UNIT_POS_X as usize;
            while w < words_per_row {
                let at = row * words_per_row + w;
                let word = words[at];
                let g = at / words_per_group;
                let s = scales[g];
                let mn = mins[g];
                let k0 = w * per_word;
                #[unroll]
                for i in 0..tile_n {
                    let r = m0 + i;
                    if r < m {
                        let base = r * k + k0;
                        let mut sqx = 0.0f32;
                        let mut sx = 0.0f32;
                        #[unroll]
                        for j in 0..per_word {
                            let code = (word >> comptime!(j as u32 * bits)) & mask;
                            let xv = x[base + j];
                            sqx += f32::cast_from(code) * xv;
                            sx += xv;
                        }
                        acc[i] += s * sqx + mn * sx;
                    }
                }
                w += WIDTH as usize;
            }
        }

        // Each row of units folds its WIDTH partial sums for every activation row in one tree.
        let stride = comptime!((WIDTH * ROWS_PER_CUBE) as usize);
        let mut partial = Shared::<[f32]>::new_slice(comptime!(stride * tile as usize));
        let lane = UNIT_POS_X as usize;
        let slot = UNIT_POS_Y as usize * WIDTH as usize + lane;
        #[unroll]
        for i in 0..tile_n {
            partial[i * stride + slot] = acc[i];
        }
        sync_cube();
        let mut half = CUBE_DIM_X as usize / 2;
        while half > 0 {
            if lane < half {
                #[unroll]
                for i in 0..tile_n {
                    let at = i * stride + slot;
                    partial[at] += partial[at + half];
                }
            }
            sync_cube();
            half /= 2;
        }
        // Lane i writes activation row i's sum.
        let r = m0 + lane;
        if lane < tile_n && row < rows && r < m {
            out[r * rows + row] = partial[lane * stride + slot - lane];
        }
    }
}

/// A packed weight's codes and scales as the kernel reads them (`crate::packed` holds them).
pub struct PackedCodes<'a> {
    /// `bits`-wide codes, `32 / bits` to a word, row-major `[rows, cols]`.
    pub words: &'a Tensor<1, Int>,
    /// One scale and one offset per `group` codes.
    pub scales: &'a Tensor<1>,
    pub mins: &'a Tensor<1>,
    pub rows: usize,
    pub bits: u32,
    pub group: usize,
}

/// `x · Wᵀ` for a packed weight on a GPU device.
///
/// # Shapes
/// - x: `[m, cols]` → `[m, w.rows]`, in x's dtype
pub fn packed_matmul(x: Tensor<2>, w: PackedCodes) -> Tensor<2> {
    let dtype = x.dtype();
    let x = if dtype == DType::F32 {
        x
    } else {
        x.cast(FloatDType::F32)
    };
    let y = Dispatch::packed_matmul(
        x.into_dispatch(),
        w.words.clone().into_dispatch(),
        &w.scales.clone().into_dispatch(),
        &w.mins.clone().into_dispatch(),
        w.rows,
        w.bits,
        w.group as u32,
    );
    let y = Tensor::<2>::from_dispatch(y);
    match dtype {
        DType::F32 => y,
        DType::F16 => y.cast(FloatDType::F16),
        DType::BF16 => y.cast(FloatDType::BF16),
        _ => y,
    }
}
