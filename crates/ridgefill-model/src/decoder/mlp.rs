//! The second half of a block, after attention: output projection and residual, the norms
//! around the MLP, and the gated MLP (SwiGLU or GeGLU).

use burn::tensor::{Tensor, activation};
use ridgefill_io::config::Activation;

use super::Decoder;
use crate::weight::{Rows, Weight};

impl Decoder {
    /// The rest of a block after attention: output projection, residual, MLP. Row-wise, so the
    /// rows of several sequences go through it as one batch.
    ///
    /// # Shapes
    /// - h: `[m, hidden]`, attn: `[m, q_dim]` → `[m, hidden]`
    pub(crate) fn block_after_attention(
        &self,
        l: usize,
        h: Tensor<2>,
        attn: Tensor<2>,
        rows: Rows,
    ) -> Tensor<2> {
        let layer = &self.layers[l];
        #[cfg(feature = "flex")]
        if layer.path == super::ExecPath::Fused {
            let h = self.linear_add(attn, &layer.o_proj, h, rows);
            let x = self.rms_norm(h.clone(), Some(&layer.pre_mlp_norm));
            let gu = self.linear(x, &layer.gate_up_proj, rows);
            let act = crate::cpu::swiglu(gu);
            return self.linear_add(act, &layer.down_proj, h, rows);
        }
        let mut out = self.linear(attn, &layer.o_proj, rows);
        if let Some(b) = &layer.o_bias {
            out = out + b.clone().unsqueeze_dim::<2>(0);
        }
        if let Some(w) = &layer.post_attn_norm {
            out = self.rms_norm(out, Some(w));
        }
        let h = h + out;
        let x = self.rms_norm(h.clone(), Some(&layer.pre_mlp_norm));
        let y = self.mlp(x, &layer.gate_up_proj, &layer.down_proj, rows);
        let y = match &layer.post_mlp_norm {
            Some(w) => self.rms_norm(y, Some(w)),
            None => y,
        };
        h + y
    }

    /// The gated MLP: `down(act(gate) · up)` with the config's activation.
    ///
    /// # Shapes
    /// - x: `[m, hidden]` → `[m, hidden]`
    fn mlp(
        &self,
        x: Tensor<2>,
        gate_up_proj: &Weight,
        down_proj: &Weight,
        rows: Rows,
    ) -> Tensor<2> {
        let ff = self.config.intermediate_size;
        let gate_up = self.linear(x, gate_up_proj, rows);
        let gate = gate_up.clone().narrow(1, 0, ff);
        let gate = match self.config.hidden_act {
            Activation::Silu => activation::silu(gate),
            Activation::GeluTanh => gelu_tanh(gate),
        };
        let up = gate_up.narrow(1, ff, ff);
        self.linear(gate * up, down_proj, rows)
    }
}

/// GELU, tanh approximation (PyTorch's `gelu(approximate="tanh")`); `x·x·x` rather than a
/// power, which GPUs leave undefined for negative bases.
fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    let cube = x.clone() * x.clone() * x.clone();
    let inner = (x.clone() + cube.mul_scalar(0.044_715)).mul_scalar(SQRT_2_OVER_PI);
    x * inner.tanh().add_scalar(1.0).mul_scalar(0.5)
}
