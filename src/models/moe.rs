//! The mixture-of-experts MLP that replaces the dense one in Mixtral, Qwen2-MoE, Qwen3-MoE and
//! OLMoE, written once over the [`Backend`] trait: a router scores the experts for each token,
//! the `top_k` best are run on the rows routed to them, and their outputs are added into each
//! token's row with the routing weights; Qwen2-MoE adds a shared expert every token goes
//! through, scaled by a sigmoid gate.
//!
//! Shapes: T = tokens in the step, E = experts, K = top_k, n_e = rows routed to expert e,
//! F = an expert's MLP size (this rank's columns of it under tensor parallelism).

use super::Uploader;
use super::config::{Fields, ModelConfig, MoeConfig};
use super::gguf::GgufFile;
use super::shard::Lin::File;
use super::shard::Shard;
use crate::backend::{Activation, Backend};
use crate::tensor::{DType, HostTensor};
use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The `config.json` keys of a family's experts.
pub struct HfKeys {
    /// The number of experts, under the first of these keys the config has (transformers 5
    /// writes Qwen3-MoE's `num_experts` as `num_local_experts`).
    pub experts: &'static [&'static str],
    /// An expert's MLP size (`intermediate_size` for Mixtral, else `moe_intermediate_size`).
    pub expert_ffn: &'static str,
    /// `norm_topk_prob`'s value where the config does not say (Mixtral always renormalises).
    pub norm_topk_prob: bool,
}

/// Reads the experts of an HF config with `num_layers` layers.
pub fn hf_config(v: &Value, num_layers: usize, keys: HfKeys) -> Result<MoeConfig> {
    let f = Fields::top(v);
    let num_experts = match keys.experts.iter().find(|k| !f.get(k).is_null()) {
        Some(k) => f.req_usize(k)?,
        None => bail!(
            "config.json lacks the number of experts ({})",
            keys.experts.join(" or ")
        ),
    };
    let top_k = f.req_usize("num_experts_per_tok")?;
    let shared_expert_ffn = f
        .usize("shared_expert_intermediate_size")?
        .filter(|&s| s > 0);
    // NOTE: Qwen's layer i is sparse where i is not in mlp_only_layers and (i + 1) is a
    // multiple of decoder_sparse_step (transformers' Qwen2MoeDecoderLayer).
    let step = f.usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        bail!("decoder_sparse_step must be positive");
    }
    let mut dense_layers: Vec<bool> = (0..num_layers).map(|i| (i + 1) % step != 0).collect();
    if let Some(only) = v.get("mlp_only_layers").filter(|o| !o.is_null()) {
        let Some(list) = only.as_array() else {
            bail!("mlp_only_layers must be a list of layer indices");
        };
        for l in list {
            match l.as_u64().map(|l| l as usize) {
                Some(l) if l < num_layers => dense_layers[l] = true,
                _ => bail!(
                    "mlp_only_layers holds {}, which is not a layer (0 to {})",
                    crate::untrusted::json(l),
                    num_layers.saturating_sub(1)
                ),
            }
        }
    }
    Ok(MoeConfig {
        num_experts,
        top_k,
        expert_ffn: f.req_usize(keys.expert_ffn)?,
        norm_topk_prob: f.bool("norm_topk_prob")?.unwrap_or(keys.norm_topk_prob),
        shared_expert_ffn,
        dense_layers,
    })
}

/// Reads the experts of a GGUF file whose `{arch}.expert_count` is set (llama.cpp's keys):
/// `expert_used_count`, `expert_feed_forward_length` (else the MLP's), the shared expert's
/// `expert_shared_feed_forward_length`, `expert_weights_norm` (else `norm_by_default`, what
/// llama.cpp does for the architecture); a layer without `ffn_gate_inp` is dense.
pub fn gguf_config(
    g: &GgufFile,
    arch: &str,
    c: &ModelConfig,
    norm_by_default: bool,
) -> Result<Option<MoeConfig>> {
    let key = |k: &str| format!("{arch}.{k}");
    let num_experts = match g.meta_usize(&key("expert_count"))? {
        None | Some(0) => return Ok(None),
        Some(n) => n,
    };
    let Some(top_k) = g.meta_usize(&key("expert_used_count"))? else {
        bail!(
            "metadata has {} but not {}",
            key("expert_count"),
            key("expert_used_count")
        );
    };
    let norm = match g.metadata().get(&key("expert_weights_norm")) {
        None => norm_by_default,
        Some(v) => v.as_bool().with_context(|| {
            format!(
                "metadata '{}' should be a boolean",
                key("expert_weights_norm")
            )
        })?,
    };
    let dense_layers: Vec<bool> = (0..c.num_layers)
        .map(|l| {
            g.tensor_info(&format!("blk.{l}.ffn_gate_inp.weight"))
                .is_none()
        })
        .collect();
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        expert_ffn: g
            .meta_usize(&key("expert_feed_forward_length"))?
            .unwrap_or(c.intermediate_size),
        norm_topk_prob: norm,
        shared_expert_ffn: g
            .meta_usize(&key("expert_shared_feed_forward_length"))?
            .filter(|&f| f > 0),
        dense_layers,
    }))
}

/// One expert's gated MLP.
struct Expert<B: Backend> {
    gate_up: B::Buf, // [2 F, hidden]: gate rows then up rows
    down: B::Buf,    // [hidden, F]
    ffn: usize,      // F
}

/// One layer's experts and router.
pub struct Moe<B: Backend> {
    /// `[E, hidden]` f32, then the shared expert's gate row where there is one.
    router: B::Buf,
    experts: Vec<Expert<B>>,
    shared: Option<Expert<B>>,
    top_k: usize,
    norm_topk_prob: bool,
}

/// Where one layer's expert tensors are, by HF name: Mixtral's
/// `block_sparse_moe.experts.{j}.w1` (gate), `w3` (up), `w2` (down), or the others'
/// `mlp.experts.{j}.{gate,up,down}_proj`: the prefix and the three projections' names.
fn names(up: &Uploader<impl Backend>, p: &str) -> Result<(String, [&'static str; 3])> {
    let mixtral = format!("{p}block_sparse_moe.");
    Ok(match up.has(&format!("{mixtral}gate.weight"))? {
        true => (mixtral, ["w1", "w3", "w2"]),
        false => (format!("{p}mlp."), ["gate_proj", "up_proj", "down_proj"]),
    })
}

impl<B: Backend> Moe<B> {
    /// Loads layer `p`'s (`model.layers.{i}.`) router, experts and shared expert: this rank's
    /// columns of each expert, as the dense MLP is split; the router whole on every rank.
    pub fn load(
        up: &mut Uploader<B>,
        sh: &Shard,
        m: &MoeConfig,
        hid: usize,
        p: &str,
    ) -> Result<Self> {
        let (base, proj) = names(up, p)?;
        let e = m.num_experts;
        let mut router = up.fetch(&format!("{base}gate.weight"), &[e, hid])?;
        // an expert's gate, up and down projections (by name) with an MLP of f
        let gated = |up: &mut Uploader<B>, [g, u, d]: [String; 3], f: usize| {
            let ffn = sh.ffn_of(f);
            if ffn.is_empty() {
                bail!(
                    "an expert's MLP of {f} cannot be split over {} ranks",
                    sh.tp
                );
            }
            let gate_up = sh.gate_up_of(up, File(&g, [f, hid]), File(&u, [f, hid]), &ffn)?;
            let down = sh.down_of(up, File(&d, [hid, f]), &ffn)?;
            Ok(Expert {
                gate_up: up.upload_linear(gate_up)?,
                down: up.upload_linear(down)?,
                ffn: ffn.len(),
            })
        };
        let mut experts = Vec::with_capacity(e);
        for j in 0..e {
            let n = proj.map(|s| format!("{base}experts.{j}.{s}.weight"));
            experts.push(gated(up, n, m.expert_ffn)?);
        }
        let shared = match m.shared_expert_ffn {
            Some(f) => {
                let name = format!("{base}shared_expert_gate.weight");
                // NOTE: `[1, hidden]` in HF files; a GGUF file may hold it as a vector
                let gate = match up.fetch_opt(&name, &[hid]).ok().flatten() {
                    Some(v) => HostTensor::new(vec![1, hid], v.data),
                    None => up.fetch(&name, &[1, hid])?,
                };
                router = super::stack(vec![router, gate]);
                let n = ["gate_proj", "up_proj", "down_proj"]
                    .map(|s| format!("{base}shared_expert.{s}.weight"));
                Some(gated(up, n, f)?)
            }
            None => None,
        };
        // NOTE: the router in f32 whatever the weights' type, so that a half-precision copy
        // routes as the checkpoint does: a flipped choice changes a token's whole MLP.
        let router = up.upload(&router, DType::F32)?;
        Ok(Moe {
            router,
            experts,
            shared,
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
        })
    }

    /// `out = Σ_k w_k · expert_k(h)` (+ the shared expert), `h` `[T, hidden]` normalised:
    /// returns `[T, hidden]`, this rank's partial sums under tensor parallelism.
    ///
    /// NOTE: the router's scores are read back and routed on the host, then each expert runs
    /// on its rows alone (a gather, the gated MLP, a weighted scatter-add). A token's output
    /// depends on its own routing only: each expert's rows go through the same batch-invariant
    /// matmuls, and the sum over its experts is taken in expert order.
    pub fn forward(
        &self,
        backend: &B,
        h: &B::Buf,
        t: usize,
        hid: usize,
        act: Activation,
    ) -> Result<B::Buf> {
        let e = self.experts.len();
        let cols = e + self.shared.is_some() as usize;
        let mut logits = backend.alloc_scratch_f32(t * cols)?; // [T, E (+1)]
        backend.matmul(h, &self.router, None, t, hid, cols, &mut logits)?;
        let logits = backend.download_f32(&logits)?;
        let routes = route(&logits, t, cols, e, self.top_k, self.norm_topk_prob);

        let mut out = backend.alloc_f32(t * hid)?; // [T, hidden], zeros
        let widest = self
            .experts
            .iter()
            .chain(&self.shared)
            .map(|x| x.ffn)
            .max()
            .unwrap_or(0);
        let mut x = backend.alloc_scratch_f32(t * hid)?; // [n_e, hidden] the rows routed
        let mut gu = backend.alloc_scratch_f32(t * 2 * widest)?; // [n_e, 2 F]
        let mut a = backend.alloc_scratch_f32(t * widest)?; // [n_e, F]
        let mut y = backend.alloc_scratch_f32(t * hid)?; // [n_e, hidden]
        let mut run = |ex: &Expert<B>, rows: &[u32], w: &[f32], gather: bool| -> Result<()> {
            let (n, idx) = (rows.len(), backend.upload_u32(rows)?);
            let input = match gather {
                true => {
                    backend.gather_rows(h, &idx, hid, &mut x)?;
                    &x
                }
                false => h,
            };
            backend.matmul_gated_act(input, &ex.gate_up, n, hid, ex.ffn, act, &mut gu, &mut a)?;
            backend.matmul(&a, &ex.down, None, n, ex.ffn, hid, &mut y)?;
            backend.scatter_add_rows(&y, &idx, &backend.upload_f32(w)?, hid, &mut out)
        };
        for (ex, (rows, w)) in self.experts.iter().zip(&routes.experts) {
            if !rows.is_empty() {
                run(ex, rows, w, true)?;
            }
        }
        if let Some(ex) = &self.shared {
            let all: Vec<u32> = (0..t as u32).collect();
            run(ex, &all, &routes.shared, false)?;
        }
        Ok(out)
    }
}

/// Each expert's rows and weights for one step, and the shared expert's weights.
#[derive(Debug, PartialEq)]
pub struct Routes {
    /// Per expert: the tokens routed to it, ascending, and their weights.
    pub experts: Vec<(Vec<u32>, Vec<f32>)>,
    /// Per token: `sigmoid` of the shared expert's gate (empty without one).
    pub shared: Vec<f32>,
}

/// Routes each token of `logits` (`[T, cols]`: E router scores, then the shared expert's gate
/// logit where `cols > e`): the softmax over the E experts in f32, the `k` largest (ties to the
/// lower index), renormalised to sum to 1 where `norm` says, as transformers does.
pub fn route(logits: &[f32], t: usize, cols: usize, e: usize, k: usize, norm: bool) -> Routes {
    let mut experts = vec![(Vec::new(), Vec::new()); e];
    let mut shared = Vec::new();
    for (tok, row) in logits.chunks_exact(cols).take(t).enumerate() {
        let scores = &row[..e];
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exp: Vec<f32> = scores.iter().map(|&s| (s - max).exp()).collect();
        let sum: f32 = exp.iter().sum();
        let mut order: Vec<usize> = (0..e).collect();
        // NOTE: a stable sort by descending probability keeps the lower index first on a tie.
        order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]));
        let top = &order[..k];
        let probs: Vec<f32> = top.iter().map(|&j| exp[j] / sum).collect();
        let denom: f32 = if norm { probs.iter().sum() } else { 1.0 };
        for (&j, p) in top.iter().zip(probs) {
            experts[j].0.push(tok as u32);
            experts[j].1.push(p / denom);
        }
        if cols > e {
            shared.push(1.0 / (1.0 + (-row[e]).exp()));
        }
    }
    Routes { experts, shared }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn softmax(x: &[f64]) -> Vec<f64> {
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    #[test]
    fn routing_picks_the_top_k_and_weighs_them_as_transformers_does() {
        // token 0: experts 2 and 0 win; token 1: 3 and 1; token 2 ties 1 and 2 at the top.
        let logits = [
            1.0f32, -2.0, 3.0, 0.5, 0.7, //
            -1.0, 2.0, 0.0, 4.0, -3.0, //
            0.0, 1.5, 1.5, -1.0, 0.0,
        ];
        for norm in [false, true] {
            let r = route(&logits, 3, 5, 4, 2, norm);
            let rows: Vec<&Vec<u32>> = r.experts.iter().map(|(rows, _)| rows).collect();
            assert_eq!(rows, [&vec![0], &vec![1, 2], &vec![0, 2], &vec![1]]);
            for (tok, picks) in [(0, [2, 0]), (1, [3, 1]), (2, [1, 2])] {
                let row: Vec<f64> = logits[tok * 5..tok * 5 + 4]
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
                let p = softmax(&row);
                let denom = if norm {
                    picks.iter().map(|&j| p[j]).sum()
                } else {
                    1.0
                };
                for j in picks {
                    let (rows, w) = &r.experts[j];
                    let i = rows.iter().position(|&x| x == tok as u32).unwrap();
                    assert!(
                        (w[i] as f64 - p[j] / denom).abs() < 1e-6,
                        "{tok} {j} {norm}"
                    );
                }
            }
            let want = [0.7f64, -3.0, 0.0].map(|x| 1.0 / (1.0 + (-x).exp()));
            for (a, b) in r.shared.iter().zip(want) {
                assert!((*a as f64 - b).abs() < 1e-6);
            }
        }
        // without a shared expert the rows are E wide and no gate is read
        let r = route(&[0.0, 1.0, 2.0], 1, 3, 3, 1, false);
        assert_eq!(r.experts[2].0, [0]);
        assert!(r.shared.is_empty());
    }

    #[test]
    fn qwen_dense_layers_follow_mlp_only_layers_and_the_sparse_step() {
        let keys = || HfKeys {
            experts: &["num_experts"],
            expert_ffn: "moe_intermediate_size",
            norm_topk_prob: false,
        };
        let v = serde_json::json!({"num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]});
        let m = hf_config(&v, 5, keys()).unwrap();
        let sparse: Vec<bool> = (0..5).map(|l| m.sparse(l)).collect();
        assert_eq!(sparse, [false, true, false, false, false]);
        assert!(!m.norm_topk_prob);
        let v = serde_json::json!({"num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "mlp_only_layers": [7]});
        let e = hf_config(&v, 5, keys()).unwrap_err().to_string();
        assert!(e.contains("mlp_only_layers holds 7"), "{e}");
        let v = serde_json::json!({"num_experts": 8, "num_experts_per_tok": 9,
            "moe_intermediate_size": 32});
        let e = hf_config(&v, 5, keys()).unwrap().validate(5).unwrap_err();
        assert!(e.to_string().contains("num_experts_per_tok"), "{e}");
    }
}
