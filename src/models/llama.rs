//! The Llama family: Llama 2/3, SmolLM2, Mistral (full attention) and Qwen2 (the same graph with
//! biases on the Q, K and V projections). Written once over the [`Backend`] trait.
//!
//! Shapes: T = tokens in the step (all sequences flattened), R = rows whose logits are wanted,
//! H = query heads, Hkv = kv heads, D = head_dim, F = intermediate size.

use super::config::ModelConfig;
use super::loader::WeightSource;
use crate::backend::{Backend, DeviceBatch, KvLayout, QkvLayout};
use crate::tensor::{DType, HostTensor};
use anyhow::{Context, Result, bail};

struct Layer<B: Backend> {
    attn_norm: B::Buf,    // [hidden] f32
    wqkv: B::Buf,         // [(H + 2 Hkv) D, hidden]: q, k and v projections stacked
    bqkv: Option<B::Buf>, // [(H + 2 Hkv) D] f32 (Qwen2)
    wo: B::Buf,           // [hidden, H D]
    mlp_norm: B::Buf,     // [hidden] f32
    w_gate_up: B::Buf,    // [2 F, hidden]: gate and up projections stacked
    w_down: B::Buf,       // [hidden, F]
}

/// The paged K and V caches of every layer: `[num_blocks, Hkv, block_size, D]` each.
pub struct KvCache<B: Backend> {
    pub k: Vec<B::Buf>,
    pub v: Vec<B::Buf>,
    pub layout: KvLayout,
}

impl<B: Backend> KvCache<B> {
    pub fn new(
        backend: &B,
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self> {
        let layout = KvLayout {
            num_blocks,
            block_size,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
        };
        let mut k = Vec::with_capacity(cfg.num_layers);
        let mut v = Vec::with_capacity(cfg.num_layers);
        for _ in 0..cfg.num_layers {
            k.push(backend.alloc_kv(layout)?);
            v.push(backend.alloc_kv(layout)?);
        }
        Ok(KvCache { k, v, layout })
    }

    /// Bytes one block takes over all layers, K and V (f32 elements).
    pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize) -> usize {
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * 4
    }
}

pub struct Llama<B: Backend> {
    pub cfg: ModelConfig,
    embed: B::Buf, // [vocab, hidden]
    layers: Vec<Layer<B>>,
    norm: B::Buf,            // [hidden] f32
    lm_head: Option<B::Buf>, // [vocab, hidden]; None when tied to `embed`
    rope_cos: B::Buf,        // [max_positions, D / 2]
    rope_sin: B::Buf,        // [max_positions, D / 2]
    max_positions: usize,
    dtype: DType,
}

/// Loads a tensor and checks its shape against what the config implies.
fn fetch(src: &dyn WeightSource, name: &str, shape: &[usize]) -> Result<HostTensor> {
    let t = src
        .get(name)?
        .with_context(|| format!("the model has no tensor '{name}'"))?;
    if t.shape != shape {
        bail!(
            "tensor '{name}' has shape {:?} but the config implies {:?}",
            t.shape,
            shape
        );
    }
    Ok(t)
}

/// Concatenates tensors along their first dimension.
fn stack(parts: Vec<HostTensor>) -> HostTensor {
    let mut shape = parts[0].shape.clone();
    shape[0] = parts.iter().map(|p| p.shape[0]).sum();
    let data = parts.into_iter().flat_map(|p| p.data).collect();
    HostTensor::new(shape, data)
}

/// Inverse frequencies of rotate-half RoPE, with Llama 3's scaling when configured.
pub fn rope_inv_freq(cfg: &ModelConfig) -> Vec<f64> {
    let d = cfg.head_dim;
    (0..d / 2)
        .map(|i| {
            let f = 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / d as f64);
            match &cfg.rope_scaling {
                None => f,
                Some(s) => {
                    let old = s.original_max_position_embeddings as f64;
                    let low_wavelen = old / s.low_freq_factor;
                    let high_wavelen = old / s.high_freq_factor;
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor
                    } else {
                        let smooth = (old / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

impl<B: Backend> Llama<B> {
    /// Uploads the weights. `max_positions` bounds the RoPE tables (the max model length).
    pub fn load(
        backend: &B,
        cfg: &ModelConfig,
        src: &dyn WeightSource,
        dtype: DType,
        max_positions: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let c = cfg;
        let (h, hkv, d, hid, f) = (
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.hidden_size,
            c.intermediate_size,
        );
        let total = c.num_layers + 2;
        let up = |t: &HostTensor, dt: DType| backend.upload_weight(t, dt);
        let embed_t = fetch(src, "model.embed_tokens.weight", &[c.vocab_size, hid])?;
        let embed = up(&embed_t, dtype)?;
        drop(embed_t);
        progress(1, total);
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}.");
            let w = |n: &str, shape: &[usize]| fetch(src, &format!("{p}{n}"), shape);
            let wqkv = stack(vec![
                w("self_attn.q_proj.weight", &[h * d, hid])?,
                w("self_attn.k_proj.weight", &[hkv * d, hid])?,
                w("self_attn.v_proj.weight", &[hkv * d, hid])?,
            ]);
            let bqkv = if c.attention_bias {
                let b = stack(vec![
                    w("self_attn.q_proj.bias", &[h * d])?,
                    w("self_attn.k_proj.bias", &[hkv * d])?,
                    w("self_attn.v_proj.bias", &[hkv * d])?,
                ]);
                Some(up(&b, DType::F32)?)
            } else {
                None
            };
            let gate_up = stack(vec![
                w("mlp.gate_proj.weight", &[f, hid])?,
                w("mlp.up_proj.weight", &[f, hid])?,
            ]);
            layers.push(Layer {
                attn_norm: up(&w("input_layernorm.weight", &[hid])?, DType::F32)?,
                wqkv: up(&wqkv, dtype)?,
                bqkv,
                wo: up(&w("self_attn.o_proj.weight", &[hid, h * d])?, dtype)?,
                mlp_norm: up(&w("post_attention_layernorm.weight", &[hid])?, DType::F32)?,
                w_gate_up: up(&gate_up, dtype)?,
                w_down: up(&w("mlp.down_proj.weight", &[hid, f])?, dtype)?,
            });
            progress(i + 2, total);
        }
        let norm = up(&fetch(src, "model.norm.weight", &[hid])?, DType::F32)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            match src.get("lm_head.weight")? {
                Some(t) if t.shape == [c.vocab_size, hid] => Some(up(&t, dtype)?),
                Some(t) => bail!(
                    "tensor 'lm_head.weight' has shape {:?}, expected {:?}",
                    t.shape,
                    [c.vocab_size, hid]
                ),
                // NOTE: some checkpoints omit lm_head although the config says untied.
                None => None,
            }
        };
        progress(total, total);
        let inv = rope_inv_freq(c);
        let mut cos = Vec::with_capacity(max_positions * d / 2);
        let mut sin = Vec::with_capacity(max_positions * d / 2);
        for p in 0..max_positions {
            for &fq in &inv {
                let a = p as f64 * fq;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok(Llama {
            cfg: c.clone(),
            embed,
            layers,
            norm,
            lm_head,
            rope_cos: backend.upload_f32(&cos)?,
            rope_sin: backend.upload_f32(&sin)?,
            max_positions,
            dtype,
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    fn qkv_layout(&self) -> QkvLayout {
        QkvLayout {
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    /// Runs every layer over the whole flattened batch and returns the logits of the rows in
    /// `batch.logits_rows`, as a device buffer `[R, vocab]`.
    pub fn forward(
        &self,
        backend: &B,
        batch: &DeviceBatch<B>,
        kv: &mut KvCache<B>,
    ) -> Result<B::Buf> {
        let c = &self.cfg;
        let t = batch.host.num_tokens();
        let r = batch.host.logits_rows.len();
        if let Some(&p) = batch.host.positions.iter().max()
            && p as usize >= self.max_positions
        {
            bail!(
                "position {p} is beyond the maximum model length {}",
                self.max_positions
            );
        }
        let (hid, f) = (c.hidden_size, c.intermediate_size);
        let ql = self.qkv_layout();
        let eps = c.rms_norm_eps as f32;
        let scale = 1.0 / (c.head_dim as f32).sqrt();

        let mut x = backend.alloc_f32(t * hid)?; // [T, hidden] residual stream
        let mut h = backend.alloc_f32(t * hid)?; // [T, hidden]
        let mut qkv = backend.alloc_f32(t * ql.row_len())?; // [T, (H + 2 Hkv) D]
        let mut attn = backend.alloc_f32(t * ql.q_len())?; // [T, H D]
        let mut gu = backend.alloc_f32(t * 2 * f)?; // [T, 2 F]
        let mut act = backend.alloc_f32(t * f)?; // [T, F]
        let mut o = backend.alloc_f32(t * hid)?; // [T, hidden] output of o_proj / down_proj

        // NOTE: each residual add is fused with the norm that follows it (add_rms_norm): the
        // layer's input norm is applied at the end of the previous layer.
        backend.embedding(&self.embed, &batch.token_ids, hid, &mut x)?;
        if let Some(first) = self.layers.first() {
            backend.rms_norm(&x, &first.attn_norm, t, hid, eps, &mut h)?;
        }
        for (l, w) in self.layers.iter().enumerate() {
            backend.matmul(&h, &w.wqkv, w.bqkv.as_ref(), t, hid, ql.row_len(), &mut qkv)?;
            backend.rope(
                &mut qkv,
                &batch.positions,
                &self.rope_cos,
                &self.rope_sin,
                t,
                ql,
            )?;
            backend.write_kv(
                &qkv,
                &batch.slot_mapping,
                t,
                ql,
                &mut kv.k[l],
                &mut kv.v[l],
                kv.layout,
            )?;
            backend.paged_attention(
                &qkv, &kv.k[l], &kv.v[l], batch, ql, kv.layout, scale, &mut attn,
            )?;
            backend.matmul(&attn, &w.wo, None, t, ql.q_len(), hid, &mut o)?;
            backend.add_rms_norm(&mut x, &o, &w.mlp_norm, t, hid, eps, &mut h)?;
            backend.matmul(&h, &w.w_gate_up, None, t, hid, 2 * f, &mut gu)?;
            backend.silu_mul(&gu, t, f, &mut act)?;
            backend.matmul(&act, &w.w_down, None, t, f, hid, &mut o)?;
            match self.layers.get(l + 1) {
                Some(next) => {
                    backend.add_rms_norm(&mut x, &o, &next.attn_norm, t, hid, eps, &mut h)?
                }
                None => backend.add_assign(&mut x, &o, t * hid)?,
            }
        }
        // Only the rows that are sampled go through the final norm and the lm_head.
        let mut xs = backend.alloc_f32(r * hid)?; // [R, hidden]
        backend.gather_rows(&x, &batch.logits_rows, hid, &mut xs)?;
        let mut xn = backend.alloc_f32(r * hid)?;
        backend.rms_norm(&xs, &self.norm, r, hid, eps, &mut xn)?;
        let mut logits = backend.alloc_f32(r * c.vocab_size)?; // [R, vocab]
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        backend.matmul(&xn, head, None, r, hid, c.vocab_size, &mut logits)?;
        Ok(logits)
    }
}
