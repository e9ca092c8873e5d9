//! Models by their hub name, as vLLM, llama.cpp (`-hf`) and mistral.rs take them:
//! `--model ORG/NAME` (an HF-layout repository: config, tokenizer, safetensors) or
//! `--model ORG/NAME:QUANT` (a GGUF repository: the file whose name carries the quant, as
//! llama.cpp's `-hf` picks it; `--gguf-file` names it outright). Files come from the Hugging
//! Face cache when they are there (the layout Python's `huggingface_hub` writes, so downloads
//! are shared with it), else are downloaded into it through the `hf-hub` crate, with progress
//! bars. `HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_TOKEN` (`HF_TOKEN_PATH`) and
//! `HF_HUB_OFFLINE` mean what they mean to `huggingface_hub`.

use anyhow::{Context, Result, bail};
use hf_hub::api::sync::ApiBuilder;
use hf_hub::{Cache, Repo, RepoType};
use std::path::{Path, PathBuf};

/// Where and how the hub is reached.
#[derive(Debug, Clone)]
pub struct HubEnv {
    /// The cache (`.../huggingface/hub`).
    pub cache: PathBuf,
    pub endpoint: String,
    pub token: Option<String>,
    /// Only the cache is read.
    pub offline: bool,
    /// Progress bars while downloading.
    pub progress: bool,
}

impl HubEnv {
    /// From the environment, as `huggingface_hub` reads it.
    pub fn from_env() -> HubEnv {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        // NOTE: the token file `huggingface-cli login` writes is under HF_HOME, wherever the
        // cache is.
        let home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            dirs::home_dir()
                .unwrap_or_else(std::env::temp_dir)
                .join(".cache/huggingface")
        });
        let cache = var("HF_HUB_CACHE").map_or_else(|| home.join("hub"), PathBuf::from);
        let token = var("HF_TOKEN").or_else(|| {
            let path = var("HF_TOKEN_PATH").map_or_else(|| home.join("token"), PathBuf::from);
            std::fs::read_to_string(path)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on")
        });
        HubEnv {
            cache,
            endpoint: var("HF_ENDPOINT").unwrap_or_else(|| "https://huggingface.co".into()),
            token,
            offline,
            progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        }
    }
}

/// Whether `spec` names a hub repository (`ORG/NAME`, `ORG/NAME:QUANT`) rather than a local
/// path: it has that shape and no such file or folder exists.
pub fn is_hub_name(spec: &str) -> bool {
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    };
    let (repo, tag) = spec.split_once(':').unwrap_or((spec, "x"));
    match repo.split_once('/') {
        Some((org, name)) => ok(org) && ok(name) && ok(tag) && !Path::new(spec).exists(),
        None => false,
    }
}

/// What to fetch of a repository.
#[derive(Debug, PartialEq)]
enum Pick {
    Gguf(String),
    /// An HF-layout model: these files, `config.json` among them.
    Hf(Vec<String>),
}

/// The files an HF-layout model needs besides its safetensors.
const HF_FILES: &[&str] = &[
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "model.safetensors.index.json",
];

/// llama.cpp's `-hf` default when no quant is named.
const DEFAULT_QUANT: &str = "Q4_K_M";

fn pick(
    repo: &str,
    files: &[String],
    quant: Option<&str>,
    gguf_file: Option<&str>,
) -> Result<Pick> {
    if let Some(f) = gguf_file {
        if !files.iter().any(|x| x == f) {
            bail!(
                "{repo} has no file {f} (--gguf-file); its GGUF files: {}",
                ggufs(files).join(", ")
            );
        }
        return Ok(Pick::Gguf(f.to_string()));
    }
    let all = ggufs(files);
    let has_hf = files.iter().any(|f| f == "config.json")
        && files.iter().any(|f| f.ends_with(".safetensors"));
    let with = |q: &str| -> Vec<&str> {
        let q = q.to_ascii_lowercase();
        all.iter()
            .copied()
            .filter(|f| has_quant(&f.to_ascii_lowercase(), &q))
            .collect()
    };
    let chosen = match quant {
        Some(q) => {
            let found = with(q);
            if found.is_empty() {
                bail!(
                    "{repo} has no GGUF file for {q}; its GGUF files: {}",
                    if all.is_empty() {
                        "none".into()
                    } else {
                        all.join(", ")
                    }
                );
            }
            found[0]
        }
        None if has_hf => {
            let mut want: Vec<String> = files
                .iter()
                .filter(|f| {
                    HF_FILES.contains(&f.as_str())
                        || (f.ends_with(".safetensors") && !f.contains('/'))
                })
                .cloned()
                .collect();
            want.sort();
            return Ok(Pick::Hf(want));
        }
        None if all.is_empty() => bail!(
            "{repo} has neither a GGUF file nor config.json with safetensors: nothing here to load"
        ),
        None => with(DEFAULT_QUANT).first().copied().unwrap_or(all[0]),
    };
    if chosen.contains("-of-") {
        bail!(
            "{chosen} is one part of a split GGUF, which is not supported yet: merge it with llama.cpp's gguf-split --merge"
        );
    }
    Ok(Pick::Gguf(chosen.to_string()))
}

/// Whether `name` carries `quant` as a whole part (both lowercase): after the start, `-`, `.`
/// or `_`, and before `-` or `.`, so that Q4_K never picks Q4_K_M.
fn has_quant(name: &str, quant: &str) -> bool {
    name.match_indices(quant).any(|(i, _)| {
        let before = name[..i]
            .chars()
            .next_back()
            .is_none_or(|c| "-._".contains(c));
        let after = name[i + quant.len()..].chars().next();
        before && after.is_none_or(|c| c == '-' || c == '.')
    })
}

/// The repository's GGUF files (not vision projectors), sorted.
fn ggufs(files: &[String]) -> Vec<&str> {
    let mut g: Vec<&str> = files
        .iter()
        .map(String::as_str)
        .filter(|f| f.ends_with(".gguf") && !f.contains("mmproj"))
        .collect();
    g.sort();
    g
}

/// The local path of the model `spec` names (`ORG/NAME[:QUANT]`) at `revision` (`main` by
/// default): a GGUF file, or an HF-layout folder in the cache's snapshot.
pub fn resolve(
    env: &HubEnv,
    spec: &str,
    revision: Option<&str>,
    gguf_file: Option<&str>,
) -> Result<PathBuf> {
    let (repo_id, quant) = match spec.split_once(':') {
        Some((r, q)) => (r, Some(q)),
        None => (spec, None),
    };
    let revision = revision.unwrap_or("main");
    let repo = Repo::with_revision(repo_id.to_string(), RepoType::Model, revision.to_string());
    let cached = Cache::new(env.cache.clone()).repo(repo.clone());
    // NOTE: the cache first, without the network: what Python downloaded is used as it is.
    let cached_files = snapshot_files(&env.cache, &repo);
    // NOTE: without a quant the choice needs the repository's whole listing, which a cache
    // holding some of its files does not give (offline, it is all there is).
    let explicit = quant.is_some() || gguf_file.is_some() || env.offline;
    let cached_pick = cached_files
        .as_ref()
        .and_then(|files| pick(repo_id, files, quant, gguf_file).ok())
        .filter(|p| explicit || matches!(p, Pick::Hf(_)));
    let local = |p: &Pick| -> Option<PathBuf> {
        match p {
            Pick::Gguf(f) => cached.get(f),
            Pick::Hf(files) if weights_complete(files) => {
                let paths: Option<Vec<PathBuf>> = files.iter().map(|f| cached.get(f)).collect();
                paths?.first()?.parent().map(Path::to_path_buf)
            }
            Pick::Hf(_) => None,
        }
    };
    if let Some(p) = cached_pick.as_ref().and_then(local) {
        return Ok(p);
    }
    if env.offline {
        bail!(
            "{spec} (revision {revision}) is not in the Hugging Face cache {} and HF_HUB_OFFLINE is set: download it first, or unset HF_HUB_OFFLINE",
            env.cache.display()
        );
    }
    let api = ApiBuilder::from_cache(Cache::new(env.cache.clone()))
        .with_endpoint(env.endpoint.clone())
        .with_token(env.token.clone())
        .with_progress(env.progress)
        .build()
        .context("cannot set up the Hugging Face client")?;
    let remote = api.repo(repo);
    let info = remote.info().map_err(|e| {
        anyhow::anyhow!(
            "cannot list {repo_id} (revision {revision}) at {}: {e} (is the name right? a private or gated model needs HF_TOKEN)",
            env.endpoint
        )
    })?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let chosen = pick(repo_id, &files, quant, gguf_file)?;
    let fetch = |f: &str| {
        remote
            .get(f)
            .map_err(|e| anyhow::anyhow!("cannot download {f} of {repo_id}: {e}"))
    };
    match chosen {
        Pick::Gguf(f) => fetch(&f),
        Pick::Hf(files) => {
            let mut dir = None;
            for f in &files {
                let p = fetch(f)?;
                dir = p.parent().map(Path::to_path_buf);
            }
            dir.context("nothing was downloaded")
        }
    }
}

/// Whether an HF-layout pick has all its weights: `model.safetensors`, or every shard its
/// index names (a download cut short leaves some out).
fn weights_complete(files: &[String]) -> bool {
    let has = |f: &str| files.iter().any(|x| x == f);
    if !has("model.safetensors.index.json") {
        return has("model.safetensors");
    }
    // NOTE: shards follow the index's naming (`model-00001-of-00004.safetensors`): all N.
    let shards: Vec<&String> = files
        .iter()
        .filter(|f| f.contains("-of-") && f.ends_with(".safetensors"))
        .collect();
    let total = shards.first().and_then(|f| {
        f.trim_end_matches(".safetensors")
            .rsplit("-of-")
            .next()?
            .parse::<usize>()
            .ok()
    });
    total.is_some_and(|n| n == shards.len())
}

/// The files of the cached snapshot that `repo`'s revision points at, if any.
fn snapshot_files(cache: &Path, repo: &Repo) -> Option<Vec<String>> {
    let root = cache.join(repo.folder_name());
    let commit = std::fs::read_to_string(root.join("refs").join(repo.revision())).ok()?;
    let snapshot = root.join("snapshots").join(commit.trim());
    let mut files: Vec<String> = std::fs::read_dir(&snapshot)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    files.sort();
    Some(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_cut_download_is_not_complete() {
        assert!(weights_complete(&names(&[
            "config.json",
            "model.safetensors"
        ])));
        assert!(!weights_complete(&names(&["config.json"])));
        let index = "model.safetensors.index.json";
        let two = [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ];
        assert!(weights_complete(&names(&[index, two[0], two[1]])));
        assert!(!weights_complete(&names(&[index, two[0]])));
        assert!(!weights_complete(&names(&[index])));
    }

    #[test]
    fn hub_names_and_paths() {
        assert!(is_hub_name("Qwen/Qwen2.5-0.5B-Instruct"));
        assert!(is_hub_name("unsloth/Qwen3-0.6B-GGUF:Q4_K_M"));
        for s in [
            "model.gguf",
            "/abs/path",
            "a/b/c",
            "../x/y",
            "a/",
            "a/b:",
            "a b/c",
        ] {
            assert!(!is_hub_name(s), "{s}");
        }
    }

    #[test]
    fn picks_as_llama_cpp_does() {
        let only_m = names(&["m-Q4_K_M.gguf"]);
        assert!(pick("r", &only_m, Some("Q4_K"), None).is_err());
        let gguf = names(&[
            "README.md",
            "m-Q4_K.gguf",
            "m-Q4_K_M.gguf",
            "m-Q8_0.gguf",
            "mmproj-m-f16.gguf",
        ]);
        let p = |q, f| pick("r", &gguf, q, f);
        assert_eq!(
            p(Some("q8_0"), None).unwrap(),
            Pick::Gguf("m-Q8_0.gguf".into())
        );
        assert_eq!(
            p(Some("Q4_K"), None).unwrap(),
            Pick::Gguf("m-Q4_K.gguf".into())
        );
        assert_eq!(p(None, None).unwrap(), Pick::Gguf("m-Q4_K_M.gguf".into()));
        assert_eq!(
            p(None, Some("m-Q8_0.gguf")).unwrap(),
            Pick::Gguf("m-Q8_0.gguf".into())
        );
        assert!(
            p(Some("Q2_K"), None)
                .unwrap_err()
                .to_string()
                .contains("m-Q8_0.gguf")
        );
        assert!(p(None, Some("nope.gguf")).is_err());
        let hf = names(&[
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "onnx/model.onnx",
            "README.md",
        ]);
        assert_eq!(
            pick("r", &hf, None, None).unwrap(),
            Pick::Hf(names(&[
                "config.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "model.safetensors.index.json",
                "tokenizer.json",
            ]))
        );
        let split = names(&[
            "m-Q4_K_M-00001-of-00002.gguf",
            "m-Q4_K_M-00002-of-00002.gguf",
        ]);
        assert!(
            pick("r", &split, None, None)
                .unwrap_err()
                .to_string()
                .contains("split")
        );
        assert!(pick("r", &names(&["README.md"]), None, None).is_err());
    }
}
