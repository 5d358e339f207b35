//! burn-flex tensors in and out of the kernels: the flex storage behind a `Tensor`, views with
//! their strides, results wrapped back, and the f16 KV cache's narrowing and widening.

use burn::backend::Flex;
use burn::backend::flex::{FlexTensor, Layout};
use burn::tensor::{Bytes, DType, Shape, Tensor};

/// The flex tensor behind `t`, copied to a contiguous layout unless `usable` accepts its own.
pub(crate) fn flex_with<const D: usize>(
    t: Tensor<D>,
    usable: impl Fn(&Layout) -> bool,
) -> FlexTensor {
    let t = t
        .try_into_primitive::<Flex>()
        .expect("cpu kernels are called only on flex tensors (see `enabled`)");
    if usable(t.layout()) {
        t
    } else {
        t.to_contiguous()
    }
}

/// The flex tensor behind `t` with unit inner stride, as the row kernels read it.
pub(crate) fn flex<const D: usize>(t: Tensor<D>) -> FlexTensor {
    flex_with(t, Layout::has_contiguous_inner)
}

/// A GEMM operand: any layout with non-negative strides as it is (a transposed view such as a
/// tied output head needs no copy), anything else made contiguous.
pub(crate) fn gemm_operand(t: Tensor<2>) -> FlexTensor {
    flex_with(t, |l| l.strides().iter().all(|&s| s >= 0))
}

pub(crate) fn wrap<const D: usize>(data: Vec<f32>, shape: [usize; D]) -> Tensor<D> {
    let layout = Layout::contiguous(Shape::from(shape.to_vec()));
    Tensor::from_primitive::<Flex>(FlexTensor::new(Bytes::from_elems(data), layout, DType::F32))
}

/// A 2-D f32 view with non-negative strides: storage from the first element, row and column
/// strides.
pub(crate) fn strided2(t: &FlexTensor) -> (&[f32], usize, usize) {
    let l = t.layout();
    let s = l.strides();
    (
        &t.storage::<f32>()[l.start_offset()..],
        s[0] as usize,
        s[1] as usize,
    )
}

/// A 2-D f32 view with unit inner stride (see [`flex`]): storage from the first element, row
/// stride.
pub(crate) fn rows2(t: &FlexTensor) -> (&[f32], usize) {
    let (s, row, _) = strided2(t);
    (s, row)
}

/// `[1, heads, rows, hd]` f32 rows as f16, for a narrow KV cache (half's slice conversion, which
/// uses F16C where the CPU has it; burn-flex's cast goes element by element).
pub fn narrow_kv(x: Tensor<4>) -> Tensor<4> {
    use half::slice::HalfFloatSliceExt;
    let dims = x.dims();
    let t = flex_with(x, Layout::is_contiguous);
    let src = &t.storage::<f32>()[t.layout().start_offset()..][..dims.iter().product()];
    let mut out = vec![half::f16::ZERO; src.len()];
    out.convert_from_f32_slice(src);
    let layout = Layout::contiguous(Shape::from(dims.to_vec()));
    Tensor::from_primitive::<Flex>(FlexTensor::new(Bytes::from_elems(out), layout, DType::F16))
}

/// An f16 `[1, heads, rows, hd]` view of a KV cache (rows contiguous within a head) widened to a
/// contiguous f32 tensor.
pub(crate) fn widen_kv(x: Tensor<4>) -> Tensor<4> {
    use half::slice::HalfFloatSliceExt;
    let [_, heads, rows, hd] = x.dims();
    let t = flex(x);
    let (src, head_stride, row_stride) = half::f16::view(&t);
    let mut out = vec![0f32; heads * rows * hd];
    for (h, dst) in out.chunks_exact_mut(rows * hd).enumerate() {
        let head = &src[h * head_stride..];
        if row_stride as usize == hd {
            head[..rows * hd].convert_to_f32_slice(dst);
        } else {
            for (r, d) in dst.chunks_exact_mut(hd).enumerate() {
                head[r * row_stride as usize..][..hd].convert_to_f32_slice(d);
            }
        }
    }
    wrap(out, [1, heads, rows, hd])
}

/// A 4-D `[1, heads, rows, hd]` f32 view: storage from the first element, head and row strides.
pub(crate) fn heads4(x: &FlexTensor) -> (&[f32], usize, isize) {
    let l = x.layout();
    let s = l.strides();
    (&x.storage::<f32>()[l.start_offset()..], s[1] as usize, s[2])
}

/// [`heads4`] for the element types a KV cache is stored as.
pub(crate) trait KvView: Sized {
    fn view(x: &FlexTensor) -> (&[Self], usize, isize);
}

impl KvView for f32 {
    fn view(x: &FlexTensor) -> (&[f32], usize, isize) {
        heads4(x)
    }
}

impl KvView for half::f16 {
    fn view(x: &FlexTensor) -> (&[half::f16], usize, isize) {
        let l = x.layout();
        let s = l.strides();
        (
            &x.storage::<half::f16>()[l.start_offset()..],
            s[1] as usize,
            s[2],
        )
    }
}
