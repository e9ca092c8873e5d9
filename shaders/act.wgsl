// Elementwise activations, one thread per output element:
//   mode 0 (gated):  out[r, i] = act(gu[r, i]) * gu[r, ffn + i]     gu: [rows, 2 ffn]
//   mode 1 (plain):  out[i] = act(out[i])                            in place
//   mode 2 (scale):  out[i] = out[i] * s                             in place
//   mode 3 (cap):    out[i] = s * tanh(out[i] / s)                   in place
//   mode 4 (clamp):  out[i] = clamp(out[i], -s, s)                   in place
// act: 0 SiLU, 1 GELU (tanh approximation), 2 GELU (erf).
struct Params {
    n: u32,     // output elements
    ffn: u32,   // mode 0: the width of gate (and of up)
    mode: u32,
    act: u32,
    s: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gu: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

// NOTE: tanh from exp of a non-positive argument, so large |x| gives ±1 and never inf / inf.
fn tanh_safe(x: f32) -> f32 {
    let e = exp(-2.0 * abs(x));
    return sign(x) * (1.0 - e) / (1.0 + e);
}

// erf by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7); WGSL has no erf.
fn erf_approx(x: f32) -> f32 {
    let a = abs(x);
    let t = 1.0 / (1.0 + 0.3275911 * a);
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
        + 0.254829592) * t * exp(-a * a);
    return sign(x) * y;
}

fn activate(x: f32) -> f32 {
    if (p.act == 0u) {
        return x / (1.0 + exp(-x));
    } else if (p.act == 1u) {
        return 0.5 * x * (1.0 + tanh_safe(0.7978845608 * (x + 0.044715 * x * x * x)));
    }
    return 0.5 * x * (1.0 + erf_approx(x * 0.70710678118));
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_id) lid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * 64u + lid.x;
    if (i >= p.n) {
        return;
    }
    if (p.mode == 0u) {
        let r = i / p.ffn;
        let c = i % p.ffn;
        out[i] = activate(gu[r * 2u * p.ffn + c]) * gu[r * 2u * p.ffn + p.ffn + c];
    } else if (p.mode == 1u) {
        out[i] = activate(out[i]);
    } else if (p.mode == 2u) {
        out[i] = out[i] * p.s;
    } else if (p.mode == 3u) {
        out[i] = p.s * tanh_safe(out[i] / p.s);
    } else {
        out[i] = clamp(out[i], -p.s, p.s);
    }
}
