//! Checks a [`ModelConfig`] before a model is built from it: sizes nonzero, heads dividing evenly,
//! every field in range, each error naming the file and the field.

use std::path::Path;

use super::*;

impl ModelConfig {
    /// Checks sizes are nonzero and head counts divide evenly; `path` names the source in errors.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |field: &str, expected: &str, found: String| IoError::Config {
            path: path.to_path_buf(),
            field: field.to_string(),
            expected: expected.to_string(),
            found,
        };
        let nonzero = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (field, v) in nonzero {
            if v == 0 {
                return Err(bad(field, "a positive size", v.to_string()));
            }
        }
        match self.head_dim {
            Some(0) => return Err(bad("head_dim", "a positive size", "0".into())),
            Some(_) => {}
            None if !self.hidden_size.is_multiple_of(self.num_attention_heads) => {
                return Err(bad(
                    "num_attention_heads",
                    &format!("a divisor of hidden_size {}", self.hidden_size),
                    self.num_attention_heads.to_string(),
                ));
            }
            None => {}
        }
        let products = [
            (
                "num_attention_heads",
                self.num_attention_heads,
                "head_dim",
                self.head_dim(),
            ),
            (
                "num_key_value_heads",
                self.num_key_value_heads,
                "head_dim",
                self.head_dim(),
            ),
            (
                "vocab_size",
                self.vocab_size,
                "hidden_size",
                self.hidden_size,
            ),
            (
                "intermediate_size",
                self.intermediate_size,
                "hidden_size",
                self.hidden_size,
            ),
            (
                "num_hidden_layers",
                self.num_hidden_layers,
                "hidden_size",
                self.hidden_size,
            ),
        ];
        for (a, x, b, y) in products {
            if x.checked_mul(y)
                .and_then(|p| p.checked_mul(self.hidden_size.max(1)))
                .is_none()
            {
                return Err(bad(
                    a,
                    &format!(
                        "a size whose product with {b} {y} and hidden_size {} fits in usize",
                        self.hidden_size
                    ),
                    x.to_string(),
                ));
            }
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(bad(
                "head_dim",
                "an even size (rotary embeddings rotate pairs)",
                self.head_dim().to_string(),
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(bad(
                "num_key_value_heads",
                &format!(
                    "a divisor of num_attention_heads {}",
                    self.num_attention_heads
                ),
                self.num_key_value_heads.to_string(),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad(
                "rms_norm_eps",
                "a positive finite number",
                self.rms_norm_eps.to_string(),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(bad(
                "rope_theta",
                "a positive finite number",
                self.rope_theta.to_string(),
            ));
        }
        let positive = [
            ("rope_local_base_freq", self.rope_local_base_freq),
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("embed_scale", self.embed_scale),
        ];
        for (field, v) in positive {
            if let Some(x) = v
                && !(x.is_finite() && x > 0.0)
            {
                return Err(bad(field, "a positive finite number", x.to_string()));
            }
        }
        if !self.norm_weight_offset.is_finite() {
            return Err(bad(
                "norm_weight_offset",
                "a finite number",
                self.norm_weight_offset.to_string(),
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(bad("sliding_window", "a positive size", "0".into()));
        }
        if !self.layer_types.is_empty() && self.layer_types.len() != self.num_hidden_layers {
            return Err(bad(
                "layer_types",
                &format!("one entry per layer ({}), or none", self.num_hidden_layers),
                self.layer_types.len().to_string(),
            ));
        }
        Ok(())
    }
}
