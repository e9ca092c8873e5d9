//! Mutation fuzzing of the model file parsers: GGUF files (header, metadata, tensor directory,
//! config, tokenizer, weights) and HF directories (config.json, generation_config.json,
//! tokenizer_config.json, the safetensors header).
//!
//! Each case takes a small valid model (the tiny GGUF files of `tiny-gguf/`, the tiny HF
//! directories of `tests/data/tiny/`), mutates it, and loads it: `load_model`, then every
//! weight of its family uploaded to the CPU backend. The property: loading returns `Ok` or
//! `Err`, never panics, aborts or runs past [`TIMEOUT`]; no single allocation is larger than
//! [`ALLOC_LIMIT`] (a size read from the file is checked before it is allocated); and an error
//! message is at most [`MAX_ERROR_LEN`] bytes with no control characters (text from the file is
//! escaped by `pagoda::untrusted`).
//!
//! Mutations: bytes flipped or overwritten anywhere; length, count, type, dimension and offset
//! fields set to extreme values (0, 1, 2^31, 2^32, 2^63, u64::MAX, ...); truncation at any
//! point; a metadata value (`llama.block_count`, `context_length`, `rope.freq_base`, the
//! tokenizer arrays, ...) rewritten to an adversarial value of any type; config keys set to
//! wrong types, huge or negative numbers, or removed; safetensors headers with huge offsets and
//! shapes, overlapping or reversed ranges, other dtypes, length fields past the end.
//!
//! CI runs `PAGODA_FUZZ_CASES` cases per target (default 512, about a second each). By hand, longer:
//!
//! ```text
//! PAGODA_FUZZ_CASES=10000 cargo test --test fuzz_loaders -- --nocapture
//! ```
//!
//! A failure prints the seed model and the list of mutations, shrunk by proptest to a minimal
//! one; `PROPTEST_RNG_SEED=<n>` replays a run. An allocation past [`ALLOC_HARD_LIMIT`] cannot be
//! caught (the process would abort or run out of memory), so it is refused and the case that
//! made it printed before the abort. A fixed input for each bug found lives in
//! `tests/errors.rs` or the parser's unit tests, so that it stays fixed whatever the seed.

mod common;

use pagoda::WeightDtype;
use pagoda::backend::cpu::CpuBackend;
use pagoda::models::{load_model, registry};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Value, json};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// A case that does not return in this long has hung.
const TIMEOUT: Duration = Duration::from_secs(10);
/// The largest single allocation a case may make. The seed models are under 1 MB, so anything
/// near this was sized from a corrupt field.
const ALLOC_LIMIT: usize = 256 << 20;
/// Allocations past this are refused (the process aborts) instead of being tried.
const ALLOC_HARD_LIMIT: usize = 2 << 30;
/// The longest acceptable error message.
const MAX_ERROR_LEN: usize = 4096;
/// RoPE tables are sized by the positions the engine uses; a corrupt context must not size them.
const MAX_POSITIONS: usize = 256;

// ---- bounded allocation ------------------------------------------------------------------

/// The system allocator, recording the largest request, refusing absurd ones.
struct Watched;

static LARGEST: AtomicUsize = AtomicUsize::new(0);
/// The case running now, printed when an allocation is refused.
static CURRENT: Mutex<String> = Mutex::new(String::new());

unsafe impl GlobalAlloc for Watched {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !check(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !check(layout.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !check(new_size) {
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Records `size`; false (refuse) past the hard limit, after printing the case.
fn check(size: usize) -> bool {
    LARGEST.fetch_max(size, Ordering::Relaxed);
    if size <= ALLOC_HARD_LIMIT {
        return true;
    }
    // NOTE: no allocation here: stderr is unbuffered and the case text is already formatted.
    let mut err = std::io::stderr().lock();
    let _ = writeln!(
        err,
        "fuzz_loaders: refusing an allocation of {size} bytes in case:"
    );
    if let Ok(c) = CURRENT.try_lock() {
        let _ = err.write_all(c.as_bytes());
        let _ = err.write_all(b"\n");
    }
    false
}

#[global_allocator]
static GLOBAL: Watched = Watched;

// ---- running one case ----------------------------------------------------------------------

/// Set when a case has not returned: see [`load_bounded`].
static HUNG: AtomicBool = AtomicBool::new(false);

/// The fuzz targets run one at a time: the allocation record is global.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn cases() -> u32 {
    std::env::var("PAGODA_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(512)
}

fn runner() -> TestRunner {
    TestRunner::new(Config {
        cases: cases(),
        // regressions are kept as fixed inputs in tests/errors.rs, not in a seed file
        failure_persistence: None,
        max_shrink_iters: 256,
        max_shrink_time: 120_000,
        ..Config::default()
    })
}

/// Loads `path` as the engine does (the model, then every weight of its family onto the CPU)
/// on another thread; what it returned, or why the case failed (a panic, a hang, a huge
/// allocation, an error message that is too long or holds control characters).
fn load_bounded(path: &Path, desc: &str) -> Result<(), TestCaseError> {
    // NOTE: a hung case keeps its thread busy; shrinking it would pile up more of them, each
    // costing the whole timeout. After a hang every case passes, so proptest reports the case
    // that hung as it was.
    if HUNG.load(Ordering::Relaxed) {
        return Ok(());
    }
    let desc = &short(desc);
    *CURRENT.lock().unwrap() = desc.to_string();
    LARGEST.store(0, Ordering::Relaxed);
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let r = catch_unwind(AssertUnwindSafe(|| load_and_upload(&p)));
        let _ = tx.send(r);
    });
    let r = match rx.recv_timeout(TIMEOUT) {
        Ok(r) => r,
        Err(_) => {
            HUNG.store(true, Ordering::Relaxed);
            return Err(TestCaseError::fail(format!(
                "loading did not return within {TIMEOUT:?}: {desc}"
            )));
        }
    };
    let largest = LARGEST.load(Ordering::Relaxed);
    if largest > ALLOC_LIMIT {
        return Err(TestCaseError::fail(format!(
            "an allocation of {largest} bytes (at most {ALLOC_LIMIT}): {desc}"
        )));
    }
    match r {
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(TestCaseError::fail(format!("panicked ({msg}): {desc}")))
        }
        Ok(Ok(())) => {
            tally("Ok");
            Ok(())
        }
        Ok(Err(e)) => {
            tally(&e);
            if e.len() > MAX_ERROR_LEN {
                return Err(TestCaseError::fail(format!(
                    "an error of {} bytes: {}…: {desc}",
                    e.len(),
                    e.chars().take(300).collect::<String>()
                )));
            }
            if let Some(c) = e.chars().find(|c| c.is_control()) {
                return Err(TestCaseError::fail(format!(
                    "an error with the control character {c:?}: {e:?}: {desc}"
                )));
            }
            Ok(())
        }
    }
}

/// How often each outcome came, printed with `PAGODA_FUZZ_VERBOSE=1`: that the mutations reach
/// past the first checks.
static OUTCOMES: Mutex<Vec<(String, usize)>> = Mutex::new(Vec::new());

fn tally(outcome: &str) {
    if std::env::var_os("PAGODA_FUZZ_VERBOSE").is_none() {
        return;
    }
    // the message without the temporary path, cut after its first words
    let o = outcome.rsplit(".gguf: ").next().unwrap_or(outcome);
    let o: String = o.chars().filter(|c| !c.is_ascii_digit()).take(70).collect();
    let mut v = OUTCOMES.lock().unwrap();
    match v.iter_mut().find(|(k, _)| *k == o) {
        Some((_, n)) => *n += 1,
        None => v.push((o, 1)),
    }
}

fn report(target: &str) {
    let mut v = std::mem::take(&mut *OUTCOMES.lock().unwrap());
    if v.is_empty() {
        return;
    }
    v.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    eprintln!("{target} outcomes:");
    for (k, n) in v {
        eprintln!("  {n:6}  {k}");
    }
}

/// `s` cut to a few KB (a mutation can hold a long string).
fn short(s: &str) -> String {
    const MAX: usize = 8000;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes in all)", &s[..end], s.len())
}

fn load_and_upload(path: &Path) -> Result<(), String> {
    let m = load_model(path).map_err(|e| format!("{e:#}"))?;
    let _ = m.tokenizer.encode("Hello, world!");
    let positions = m.config.max_position_embeddings.min(MAX_POSITIONS);
    let backend = CpuBackend::new();
    registry::load(
        &backend,
        &m.config,
        m.weights.as_ref(),
        WeightDtype::Auto,
        positions,
        &Default::default(),
        &mut |_, _| {},
    )
    .map(|_| ())
    .map_err(|e| format!("{e:#}"))
}

// ---- values ----------------------------------------------------------------------------

/// Integers that break size arithmetic.
const EXTREMES: &[u64] = &[
    0,
    1,
    2,
    3,
    255,
    0x7fff_ffff,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    1 << 40,
    1 << 53,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

fn extreme() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => proptest::sample::select(EXTREMES),
        1 => any::<u64>(),
        1 => 0u64..4096,
    ]
}

/// Text that must come out escaped.
const NASTY: &str = "evil\u{1b}[2J\nINFO forged\r\u{202e}";

// ---- GGUF ------------------------------------------------------------------------------

const VT_U8: u32 = 0;
const VT_I32: u32 = 5;
const VT_F32: u32 = 6;
const VT_BOOL: u32 = 7;
const VT_STRING: u32 = 8;
const VT_ARRAY: u32 = 9;
const VT_U64: u32 = 10;
const VT_I64: u32 = 11;
const VT_F64: u32 = 12;
const VT_U32: u32 = 4;

/// A valid GGUF file taken apart: what the mutations edit.
#[derive(Clone)]
struct Gguf {
    version: u32,
    kvs: Vec<(Vec<u8>, u32, Vec<u8>)>,
    /// name, dims, type, offset relative to the data section
    tensors: Vec<(Vec<u8>, Vec<u64>, u32, u64)>,
    alignment: usize,
    data: Vec<u8>,
}

/// A field of the serialized file that holds a number: where it is and how wide.
#[derive(Clone, Copy, Debug)]
struct Field {
    what: &'static str,
    at: usize,
    width: usize,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    fn string(&mut self) -> Vec<u8> {
        let n = self.u64() as usize;
        self.take(n).to_vec()
    }
    fn skip_value(&mut self, vt: u32) {
        match vt {
            0 | 1 | 7 => self.pos += 1,
            2 | 3 => self.pos += 2,
            4..=6 => self.pos += 4,
            10..=12 => self.pos += 8,
            VT_STRING => {
                self.string();
            }
            VT_ARRAY => {
                let et = self.u32();
                let n = self.u64();
                for _ in 0..n {
                    self.skip_value(et);
                }
            }
            _ => panic!("seed has value type {vt}"),
        }
    }
}

impl Gguf {
    /// Parses a seed (trusted: a valid file).
    fn parse(b: &[u8]) -> Gguf {
        let mut c = Cursor { b, pos: 4 };
        let version = c.u32();
        let nt = c.u64();
        let nkv = c.u64();
        let mut kvs = vec![];
        let mut alignment = 32;
        for _ in 0..nkv {
            let k = c.string();
            let vt = c.u32();
            let start = c.pos;
            c.skip_value(vt);
            let raw = b[start..c.pos].to_vec();
            if k == b"general.alignment" {
                alignment = u32::from_le_bytes(raw[..4].try_into().unwrap()) as usize;
            }
            kvs.push((k, vt, raw));
        }
        let mut tensors = vec![];
        for _ in 0..nt {
            let name = c.string();
            let nd = c.u32();
            let dims = (0..nd).map(|_| c.u64()).collect();
            let ty = c.u32();
            let off = c.u64();
            tensors.push((name, dims, ty, off));
        }
        let data_start = c.pos.next_multiple_of(alignment);
        Gguf {
            version,
            kvs,
            tensors,
            alignment,
            data: b[data_start..].to_vec(),
        }
    }

    /// The file, and where its numeric fields are.
    fn write(&self) -> (Vec<u8>, Vec<Field>) {
        let mut b = b"GGUF".to_vec();
        let mut fields = vec![];
        let field = |b: &Vec<u8>, what, width| Field {
            what,
            at: b.len(),
            width,
        };
        fields.push(field(&b, "version", 4));
        b.extend(self.version.to_le_bytes());
        fields.push(field(&b, "tensor count", 8));
        b.extend((self.tensors.len() as u64).to_le_bytes());
        fields.push(field(&b, "metadata count", 8));
        b.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, vt, raw) in &self.kvs {
            fields.push(field(&b, "key length", 8));
            b.extend((k.len() as u64).to_le_bytes());
            b.extend(k);
            fields.push(field(&b, "value type", 4));
            b.extend(vt.to_le_bytes());
            let start = b.len();
            b.extend(raw);
            // the lengths and types inside the value (a few of them: the token arrays are long)
            let mut c = Cursor { b: raw, pos: 0 };
            value_fields(&mut c, *vt, start, &mut fields, &mut 8);
        }
        for (name, dims, ty, off) in &self.tensors {
            fields.push(field(&b, "tensor name length", 8));
            b.extend((name.len() as u64).to_le_bytes());
            b.extend(name);
            fields.push(field(&b, "tensor dim count", 4));
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                fields.push(field(&b, "tensor dim", 8));
                b.extend(d.to_le_bytes());
            }
            fields.push(field(&b, "tensor type", 4));
            b.extend(ty.to_le_bytes());
            fields.push(field(&b, "tensor offset", 8));
            b.extend(off.to_le_bytes());
        }
        b.resize(b.len().next_multiple_of(self.alignment), 0);
        b.extend(&self.data);
        (b, fields)
    }

    fn set(&mut self, key: &str, vt: u32, raw: Vec<u8>) {
        match self.kvs.iter_mut().find(|(k, _, _)| k == key.as_bytes()) {
            Some(kv) => *kv = (key.as_bytes().to_vec(), vt, raw),
            None => self.kvs.push((key.as_bytes().to_vec(), vt, raw)),
        }
    }

    /// The array of strings `key`, if the file has one.
    fn strings(&self, key: &str) -> Option<Vec<String>> {
        let (_, vt, raw) = self.kvs.iter().find(|(k, _, _)| k == key.as_bytes())?;
        let mut c = Cursor { b: raw, pos: 0 };
        if *vt != VT_ARRAY || c.u32() != VT_STRING {
            return None;
        }
        let n = c.u64();
        Some(
            (0..n)
                .map(|_| String::from_utf8_lossy(&c.string()).into_owned())
                .collect(),
        )
    }

    fn arch(&self) -> String {
        self.kvs
            .iter()
            .find(|(k, _, _)| k == b"general.architecture")
            .map(|(_, _, raw)| String::from_utf8_lossy(&raw[8..]).into_owned())
            .unwrap_or_default()
    }
}

/// Records the length and type fields of a value at `base`, at most `budget` of them.
fn value_fields(c: &mut Cursor, vt: u32, base: usize, out: &mut Vec<Field>, budget: &mut u32) {
    let mut rec = |what, at, width, budget: &mut u32| {
        if *budget > 0 {
            *budget -= 1;
            out.push(Field { what, at, width });
        }
    };
    match vt {
        VT_STRING => {
            rec("string length", base + c.pos, 8, budget);
            c.string();
        }
        VT_ARRAY => {
            rec("array element type", base + c.pos, 4, budget);
            let et = c.u32();
            rec("array length", base + c.pos, 8, budget);
            let n = c.u64();
            for _ in 0..n {
                if *budget > 0 && matches!(et, VT_STRING | VT_ARRAY) {
                    value_fields(c, et, base, out, budget);
                } else {
                    c.skip_value(et);
                }
            }
        }
        _ => {
            let at = base + c.pos;
            c.skip_value(vt);
            let width = c.pos + base - at;
            rec("scalar value", at, width, budget);
        }
    }
}

/// An adversarial metadata value.
#[derive(Clone, Debug)]
enum GVal {
    U32(u32),
    U64(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(u8),
    Str(String),
    /// an array of this many u8 zeros
    BytesArr(usize),
    I32Arr(Vec<i32>),
    F32Arr(Vec<f32>),
    StrArr(Vec<String>),
    /// bools, as raw bytes (only 0 and 1 are valid)
    BoolArr(Vec<u8>),
    /// an array of arrays
    Nested(usize),
}

impl GVal {
    fn encode(&self) -> (u32, Vec<u8>) {
        let s = |s: &str| {
            let mut v = (s.len() as u64).to_le_bytes().to_vec();
            v.extend(s.as_bytes());
            v
        };
        let arr = |et: u32, n: usize, items: Vec<u8>| {
            let mut v = et.to_le_bytes().to_vec();
            v.extend((n as u64).to_le_bytes());
            v.extend(items);
            (VT_ARRAY, v)
        };
        match self {
            GVal::U32(x) => (VT_U32, x.to_le_bytes().to_vec()),
            GVal::U64(x) => (VT_U64, x.to_le_bytes().to_vec()),
            GVal::I32(x) => (VT_I32, x.to_le_bytes().to_vec()),
            GVal::I64(x) => (VT_I64, x.to_le_bytes().to_vec()),
            GVal::F32(x) => (VT_F32, x.to_le_bytes().to_vec()),
            GVal::F64(x) => (VT_F64, x.to_le_bytes().to_vec()),
            GVal::Bool(x) => (VT_BOOL, vec![*x]),
            GVal::Str(x) => (VT_STRING, s(x)),
            GVal::BytesArr(n) => arr(VT_U8, *n, vec![0; *n]),
            GVal::I32Arr(v) => arr(
                VT_I32,
                v.len(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            GVal::F32Arr(v) => arr(
                VT_F32,
                v.len(),
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            GVal::StrArr(v) => arr(VT_STRING, v.len(), v.iter().flat_map(|x| s(x)).collect()),
            GVal::BoolArr(v) => arr(VT_BOOL, v.len(), v.clone()),
            GVal::Nested(n) => {
                let inner = arr(VT_U32, 1, 7u32.to_le_bytes().to_vec()).1;
                arr(VT_ARRAY, *n, inner.repeat(*n))
            }
        }
    }
}

fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just(NASTY.to_string()),
        Just("x".repeat(20_000)),
        Just("llama".to_string()),
        Just("gpt2".to_string()),
        Just("llama3".to_string()),
        Just("<unk>".to_string()),
        Just("a b".to_string()),
        "[ -~]{0,12}",
    ]
}

fn gval() -> impl Strategy<Value = GVal> {
    let f32s = prop_oneof![
        Just(0.0f32),
        Just(-1.0),
        Just(1e-30),
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(f32::MAX),
        Just(1e6),
        any::<f32>(),
    ];
    prop_oneof![
        extreme().prop_map(|x| GVal::U32(x as u32)),
        extreme().prop_map(GVal::U64),
        extreme().prop_map(|x| GVal::I32(x as i32)),
        extreme().prop_map(|x| GVal::I64(x as i64)),
        extreme().prop_map(|x| GVal::I64((x as i64).wrapping_neg())),
        f32s.clone().prop_map(GVal::F32),
        f32s.clone().prop_map(|x| GVal::F64(x as f64)),
        any::<u8>().prop_map(GVal::Bool),
        any_text().prop_map(GVal::Str),
        prop_oneof![Just(0usize), Just(1), Just(100_000), 0usize..400].prop_map(GVal::BytesArr),
        proptest::collection::vec(extreme().prop_map(|x| x as i32), 0..400).prop_map(GVal::I32Arr),
        proptest::collection::vec(f32s, 0..400).prop_map(GVal::F32Arr),
        proptest::collection::vec(any_text(), 0..400).prop_map(GVal::StrArr),
        proptest::collection::vec(prop_oneof![8 => 0u8..2, 1 => any::<u8>()], 0..40)
            .prop_map(GVal::BoolArr),
        (0usize..50).prop_map(GVal::Nested),
    ]
}

/// Metadata keys whose values size or shape the model; `{a}` is the architecture.
const GGUF_KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "{a}.block_count",
    "{a}.context_length",
    "{a}.embedding_length",
    "{a}.feed_forward_length",
    "{a}.attention.head_count",
    "{a}.attention.head_count_kv",
    "{a}.attention.key_length",
    "{a}.attention.value_length",
    "{a}.attention.layer_norm_rms_epsilon",
    "{a}.attention.layer_norm_epsilon",
    "{a}.attention.sliding_window",
    "{a}.attention.sliding_window_pattern",
    "{a}.attention.scale",
    "{a}.rope.freq_base",
    "{a}.rope.freq_base_swa",
    "{a}.rope.dimension_count",
    "{a}.rope.scaling.type",
    "{a}.rope.scaling.factor",
    "{a}.rope.scaling.original_context_length",
    "{a}.rope.scaling.attn_factor",
    "{a}.vocab_size",
    "{a}.final_logit_softcapping",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
    "general.sampling.temp",
    "general.sampling.top_k",
];

#[derive(Clone, Debug)]
enum GgufMut {
    /// Sets a metadata key (one of [`GGUF_KEYS`], or one the file has) to a value.
    SetMeta(Index, bool, GVal),
    RemoveMeta(Index),
    /// Sets dimension `.1` of tensor `.0`.
    SetDim(Index, Index, u64),
    AddDim(Index, u64),
    SetType(Index, u32),
    SetOffset(Index, u64),
    RemoveTensor(Index),
    /// Makes the tokenizer SentencePiece (`llama`, with scores), one piece replaced by a long
    /// one of this many bytes.
    Spm(Option<(Index, usize)>),
    /// Sets a numeric field of the file (a count, length, type, dim, offset) to a value.
    Field(Index, u64),
    Flip(Index, u8),
    Overwrite(Index, u8),
    Truncate(Index),
}

fn gguf_mut() -> impl Strategy<Value = GgufMut> {
    prop_oneof![
        4 => (any::<Index>(), any::<bool>(), gval()).prop_map(|(i, b, v)| GgufMut::SetMeta(i, b, v)),
        1 => any::<Index>().prop_map(GgufMut::RemoveMeta),
        2 => (any::<Index>(), any::<Index>(), extreme()).prop_map(|(t, d, v)| GgufMut::SetDim(t, d, v)),
        1 => (any::<Index>(), extreme()).prop_map(|(t, v)| GgufMut::AddDim(t, v)),
        1 => (any::<Index>(), prop_oneof![0u32..42, any::<u32>()]).prop_map(|(t, v)| GgufMut::SetType(t, v)),
        1 => (any::<Index>(), extreme()).prop_map(|(t, v)| GgufMut::SetOffset(t, v)),
        1 => any::<Index>().prop_map(GgufMut::RemoveTensor),
        1 => proptest::option::of((any::<Index>(), prop_oneof![1usize..64, Just(100_000), Just(1 << 20)]))
            .prop_map(GgufMut::Spm),
        4 => (any::<Index>(), extreme()).prop_map(|(f, v)| GgufMut::Field(f, v)),
        2 => (any::<Index>(), 0u8..8).prop_map(|(p, b)| GgufMut::Flip(p, b)),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(p, b)| GgufMut::Overwrite(p, b)),
        1 => any::<Index>().prop_map(GgufMut::Truncate),
    ]
}

/// The mutated file. Structured mutations edit the parsed file (and it is written again with
/// its data section realigned); byte mutations then edit the bytes.
fn mutate_gguf(seed: &Gguf, muts: &[GgufMut]) -> (Vec<u8>, Vec<String>) {
    let mut notes = vec![];
    let mut g = seed.clone();
    let arch = g.arch();
    for m in muts {
        let nt = g.tensors.len();
        match m {
            GgufMut::SetMeta(i, known, v) => {
                let key = if *known || g.kvs.is_empty() {
                    i.get(GGUF_KEYS).replace("{a}", &arch)
                } else {
                    String::from_utf8_lossy(&i.get(&g.kvs).0).into_owned()
                };
                let (vt, raw) = v.encode();
                g.set(&key, vt, raw);
            }
            GgufMut::RemoveMeta(i) if !g.kvs.is_empty() => {
                g.kvs.remove(i.index(g.kvs.len()));
            }
            GgufMut::SetDim(t, d, v) if nt > 0 => {
                let dims = &mut g.tensors[t.index(nt)].1;
                if !dims.is_empty() {
                    let n = dims.len();
                    dims[d.index(n)] = *v;
                }
            }
            GgufMut::AddDim(t, v) if nt > 0 => g.tensors[t.index(nt)].1.push(*v),
            GgufMut::SetType(t, v) if nt > 0 => g.tensors[t.index(nt)].2 = *v,
            GgufMut::SetOffset(t, v) if nt > 0 => g.tensors[t.index(nt)].3 = *v,
            GgufMut::RemoveTensor(t) if nt > 0 => {
                g.tensors.remove(t.index(nt));
            }
            GgufMut::Spm(long) => {
                let Some(mut tokens) = g.strings("tokenizer.ggml.tokens") else {
                    continue;
                };
                if let Some((i, len)) = long
                    && !tokens.is_empty()
                {
                    let n = tokens.len();
                    tokens[i.index(n)] = "b".repeat(*len);
                }
                let n = tokens.len();
                let set = |g: &mut Gguf, k: &str, v: GVal| {
                    let (vt, raw) = v.encode();
                    g.set(k, vt, raw);
                };
                set(&mut g, "tokenizer.ggml.tokens", GVal::StrArr(tokens));
                set(&mut g, "tokenizer.ggml.model", GVal::Str("llama".into()));
                let scores = (0..n).map(|i| -(i as f32)).collect();
                set(&mut g, "tokenizer.ggml.scores", GVal::F32Arr(scores));
                if !g
                    .kvs
                    .iter()
                    .any(|(k, _, _)| k == b"tokenizer.ggml.token_type")
                {
                    set(
                        &mut g,
                        "tokenizer.ggml.token_type",
                        GVal::I32Arr(vec![1; n]),
                    );
                }
            }
            _ => {}
        }
    }
    let (mut b, fields) = g.write();
    for m in muts {
        if b.is_empty() {
            break;
        }
        match m {
            GgufMut::Field(f, v) => {
                let f = f.get(&fields);
                notes.push(format!("{} at {} set to {v}", f.what, f.at));
                if f.at + f.width <= b.len() {
                    b[f.at..f.at + f.width].copy_from_slice(&v.to_le_bytes()[..f.width]);
                }
            }
            GgufMut::Flip(p, bit) => {
                let n = b.len();
                b[p.index(n)] ^= 1 << bit;
            }
            GgufMut::Overwrite(p, v) => {
                let n = b.len();
                b[p.index(n)] = *v;
            }
            GgufMut::Truncate(p) => {
                let n = b.len();
                b.truncate(p.index(n));
            }
            _ => {}
        }
    }
    (b, notes)
}

fn gguf_seeds() -> &'static Vec<(String, Gguf)> {
    static SEEDS: OnceLock<Vec<(String, Gguf)>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        common::gguf_families()
            .map(|m| {
                let p = common::model_path(&format!("tiny-gguf/{m}.gguf"));
                let g = Gguf::parse(&std::fs::read(&p).unwrap());
                // the writer reproduces the seed byte for byte
                assert_eq!(g.write().0, std::fs::read(&p).unwrap(), "{m}");
                (m.to_string(), g)
            })
            .collect()
    })
}

#[test]
fn gguf_files() {
    let seeds = gguf_seeds();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    let t = std::time::Instant::now();
    let strategy = (any::<Index>(), proptest::collection::vec(gguf_mut(), 1..6));
    let r = runner().run(&strategy, |(seed, muts)| {
        let (name, g) = seed.get(seeds);
        let (bytes, notes) = mutate_gguf(g, &muts);
        std::fs::write(&path, bytes).unwrap();
        load_bounded(
            &path,
            &format!("seed tiny-gguf/{name}.gguf, fields {notes:?}, mutations {muts:?}"),
        )
    });
    eprintln!("gguf_files: {} cases in {:?}", cases(), t.elapsed());
    report("gguf_files");
    if let Err(e) = r {
        panic!("{e}");
    }
}

/// Every seed loads unmutated: the harness tests what it means to.
#[test]
fn seeds_load() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for (name, g) in gguf_seeds() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.gguf");
        std::fs::write(&p, g.write().0).unwrap();
        load_and_upload(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    for name in common::TINY_FAMILIES {
        load_and_upload(&tiny_dir(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

// ---- HF directories -----------------------------------------------------------------

fn tiny_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tiny")
        .join(name)
}

/// An adversarial JSON value.
fn jval() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        extreme().prop_map(Value::from),
        extreme().prop_map(|x| Value::from((x as i64).wrapping_neg())),
        prop_oneof![
            Just(1.5f64),
            Just(-1.0),
            Just(0.0),
            Just(1e300),
            Just(-1e300),
            Just(1e-300),
            Just(8192.0),
            Just(18446744073709551616.0),
            any::<f64>()
        ]
        .prop_map(Value::from),
        any_text().prop_map(Value::from),
        Just(json!("llama3")),
        Just(json!("longrope")),
        Just(json!("sliding_attention")),
        Just(json!("full_attention")),
    ];
    leaf.prop_recursive(2, 400, 300, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..300).prop_map(Value::Array),
            proptest::collection::vec((proptest::sample::select(NESTED_KEYS), inner), 0..4)
                .prop_map(|kv| Value::Object(
                    kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
                )),
        ]
    })
}

const CONFIG_KEYS: &[&str] = &[
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "layer_norm_epsilon",
    "layer_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rope_local_base_freq",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "sliding_window",
    "sliding_window_pattern",
    "layer_types",
    "tie_word_embeddings",
    "hidden_act",
    "hidden_activation",
    "bos_token_id",
    "eos_token_id",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "attention_bias",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_ctx",
    "multi_query",
    "new_decoder_architecture",
    "num_kv_heads",
    "num_ln_in_parallel_attn",
    "parallel_attn",
    "alibi",
    "bias",
    "torch_dtype",
    "dtype",
];

const NESTED_KEYS: &[&str] = &[
    "rope_theta",
    "rope_type",
    "type",
    "factor",
    "short_factor",
    "long_factor",
    "original_max_position_embeddings",
    "partial_rotary_factor",
    "low_freq_factor",
    "high_freq_factor",
    "attention_factor",
    "full_attention",
    "sliding_attention",
];

const GEN_KEYS: &[&str] = &[
    "eos_token_id",
    "bos_token_id",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "do_sample",
];

const TOKENIZER_CONFIG_KEYS: &[&str] = &[
    "bos_token",
    "eos_token",
    "add_bos_token",
    "chat_template",
    "unk_token",
    "pad_token",
];

/// JSON pointers into tokenizer.json.
const TOKENIZER_PATHS: &[&str] = &[
    "/model/type",
    "/model/vocab",
    "/model/merges",
    "/model/merges/0",
    "/model/unk_token",
    "/model/byte_fallback",
    "/model/dropout",
    "/added_tokens",
    "/added_tokens/0",
    "/added_tokens/0/id",
    "/added_tokens/0/content",
    "/added_tokens/1/id",
    "/normalizer",
    "/pre_tokenizer",
    "/pre_tokenizer/type",
    "/post_processor",
    "/post_processor/type",
    "/decoder",
    "/truncation",
    "/padding",
];

const DTYPES: &[&str] = &[
    "F32", "F16", "BF16", "F64", "I8", "U8", "I64", "BOOL", "F8_E4M3", "XX", "",
];

#[derive(Clone, Debug)]
enum HfMut {
    Config(Index, Value),
    ConfigRemove(Index),
    /// A key inside `rope_parameters`/`rope_scaling` (created if absent).
    ConfigNested(bool, Index, Value),
    Generation(Index, Value),
    TokenizerConfig(Index, Value),
    /// A value in tokenizer.json (a path of [`TOKENIZER_PATHS`]).
    TokenizerJson(Index, Value),
    /// A token of the vocabulary gets this id.
    TokenizerVocabId(Index, u64),
    /// One byte of config.json.
    ConfigByte(Index, u8),
    StShape(Index, Vec<u64>),
    StOffsets(Index, u64, u64),
    /// Tensor `.0` gets the data range of tensor `.1`.
    StShareRange(Index, Index),
    StDtype(Index, &'static str),
    StRemove(Index),
    StHeaderLen(u64),
    StHeaderByte(Index, u8),
    StTruncate(Index),
}

fn hf_mut() -> impl Strategy<Value = HfMut> {
    prop_oneof![
        4 => (any::<Index>(), jval()).prop_map(|(i, v)| HfMut::Config(i, v)),
        1 => any::<Index>().prop_map(HfMut::ConfigRemove),
        2 => (any::<bool>(), any::<Index>(), jval()).prop_map(|(b, i, v)| HfMut::ConfigNested(b, i, v)),
        1 => (any::<Index>(), jval()).prop_map(|(i, v)| HfMut::Generation(i, v)),
        1 => (any::<Index>(), jval()).prop_map(|(i, v)| HfMut::TokenizerConfig(i, v)),
        1 => (any::<Index>(), jval()).prop_map(|(i, v)| HfMut::TokenizerJson(i, v)),
        1 => (any::<Index>(), extreme()).prop_map(|(i, v)| HfMut::TokenizerVocabId(i, v)),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| HfMut::ConfigByte(i, v)),
        2 => (any::<Index>(), proptest::collection::vec(extreme(), 0..5)).prop_map(|(i, v)| HfMut::StShape(i, v)),
        2 => (any::<Index>(), extreme(), extreme()).prop_map(|(i, a, b)| HfMut::StOffsets(i, a, b)),
        1 => (any::<Index>(), any::<Index>()).prop_map(|(a, b)| HfMut::StShareRange(a, b)),
        1 => (any::<Index>(), proptest::sample::select(DTYPES)).prop_map(|(i, d)| HfMut::StDtype(i, d)),
        1 => any::<Index>().prop_map(HfMut::StRemove),
        1 => extreme().prop_map(HfMut::StHeaderLen),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, v)| HfMut::StHeaderByte(i, v)),
        1 => any::<Index>().prop_map(HfMut::StTruncate),
    ]
}

struct HfSeed {
    name: String,
    config: Value,
    generation: Value,
    tokenizer_config: Value,
    tokenizer: Value,
    /// the safetensors header (tensor name -> entry) and the data after it
    st_header: serde_json::Map<String, Value>,
    st_data: Vec<u8>,
}

fn hf_seeds() -> &'static Vec<HfSeed> {
    static SEEDS: OnceLock<Vec<HfSeed>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let json = |p: PathBuf| serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
        common::TINY_FAMILIES
            .iter()
            .map(|m| {
                let d = tiny_dir(m);
                let st = std::fs::read(d.join("model.safetensors")).unwrap();
                let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
                HfSeed {
                    name: m.to_string(),
                    config: json(d.join("config.json")),
                    generation: json(d.join("generation_config.json")),
                    tokenizer_config: json(d.join("tokenizer_config.json")),
                    tokenizer: json(d.join("tokenizer.json")),
                    st_header: serde_json::from_slice(&st[8..8 + n]).unwrap(),
                    st_data: st[8 + n..].to_vec(),
                }
            })
            .collect()
    })
}

/// Writes the mutated directory into `dir`.
fn write_hf(seed: &HfSeed, muts: &[HfMut], dir: &Path) {
    let mut config = seed.config.clone();
    let mut generation = seed.generation.clone();
    let mut tok_config = seed.tokenizer_config.clone();
    let mut tokenizer = seed.tokenizer.clone();
    let mut header = seed.st_header.clone();
    let mut names: Vec<String> = header
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort();
    let mut config_bytes_edits = vec![];
    let mut header_len = None;
    let mut header_bytes_edits = vec![];
    let mut cut = None;
    for m in muts {
        match m {
            HfMut::Config(i, v) => config[*i.get(CONFIG_KEYS)] = v.clone(),
            HfMut::ConfigRemove(i) => {
                if let Some(o) = config.as_object_mut() {
                    o.remove(*i.get(CONFIG_KEYS));
                }
            }
            HfMut::ConfigNested(scaling, i, v) => {
                let parent = if *scaling {
                    "rope_scaling"
                } else {
                    "rope_parameters"
                };
                if !config[parent].is_object() {
                    config[parent] = json!({});
                }
                config[parent][*i.get(NESTED_KEYS)] = v.clone();
            }
            HfMut::Generation(i, v) => generation[*i.get(GEN_KEYS)] = v.clone(),
            HfMut::TokenizerConfig(i, v) => tok_config[*i.get(TOKENIZER_CONFIG_KEYS)] = v.clone(),
            HfMut::TokenizerJson(i, v) => {
                let path: &str = TOKENIZER_PATHS[i.index(TOKENIZER_PATHS.len())];
                if let Some(x) = tokenizer.pointer_mut(path) {
                    *x = v.clone();
                }
            }
            HfMut::TokenizerVocabId(i, id) => {
                if let Some(vocab) = tokenizer
                    .pointer_mut("/model/vocab")
                    .and_then(Value::as_object_mut)
                    && !vocab.is_empty()
                {
                    let k = i.index(vocab.len());
                    if let Some((_, v)) = vocab.iter_mut().nth(k) {
                        *v = json!(id);
                    }
                }
            }
            HfMut::ConfigByte(i, v) => config_bytes_edits.push((*i, *v)),
            HfMut::StShape(i, shape) if !names.is_empty() => {
                header[i.get(&names)]["shape"] = json!(shape);
            }
            HfMut::StOffsets(i, a, b) if !names.is_empty() => {
                header[i.get(&names)]["data_offsets"] = json!([a, b]);
            }
            HfMut::StShareRange(a, b) if !names.is_empty() => {
                let r = header[b.get(&names)]["data_offsets"].clone();
                header[a.get(&names)]["data_offsets"] = r;
            }
            HfMut::StDtype(i, d) if !names.is_empty() => {
                header[i.get(&names)]["dtype"] = json!(d);
            }
            HfMut::StRemove(i) if !names.is_empty() => {
                let n = i.get(&names).clone();
                header.remove(&n);
                names.retain(|x| *x != n);
            }
            HfMut::StHeaderLen(n) => header_len = Some(*n),
            HfMut::StHeaderByte(i, v) => header_bytes_edits.push((*i, *v)),
            HfMut::StTruncate(i) => cut = Some(*i),
            _ => {}
        }
    }
    let mut cfg = serde_json::to_vec(&config).unwrap();
    for (i, v) in config_bytes_edits {
        let n = cfg.len();
        cfg[i.index(n)] = v;
    }
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_vec(&generation).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec(&tok_config).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec(&tokenizer).unwrap(),
    )
    .unwrap();
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
    for (i, v) in header_bytes_edits {
        let n = h.len();
        h[i.index(n)] = v;
    }
    let mut st = header_len.unwrap_or(h.len() as u64).to_le_bytes().to_vec();
    st.extend(h);
    st.extend(&seed.st_data);
    if let Some(i) = cut {
        let n = st.len();
        st.truncate(i.index(n));
    }
    std::fs::write(dir.join("model.safetensors"), st).unwrap();
}

#[test]
fn hf_directories() {
    let seeds = hf_seeds();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let t = std::time::Instant::now();
    let strategy = (any::<Index>(), proptest::collection::vec(hf_mut(), 1..6));
    let r = runner().run(&strategy, |(seed, muts)| {
        let s = seed.get(seeds);
        write_hf(s, &muts, dir.path());
        load_bounded(
            dir.path(),
            &format!("seed tests/data/tiny/{}, mutations {muts:?}", s.name),
        )
    });
    eprintln!("hf_directories: {} cases in {:?}", cases(), t.elapsed());
    report("hf_directories");
    if let Err(e) = r {
        panic!("{e}");
    }
}
