//! Hugging Face safetensors checkpoints (one file or index-sharded). Each file's header is
//! checked here before MLX reads it lazily, so a truncated or corrupt download is an error
//! at load time naming the file, not a crash mid-generation.

use crate::{Error, Result};
use mlx::Array;
use serde::Deserialize;
use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Headers larger than this are refused (real ones are well under 10 MB).
const MAX_HEADER_BYTES: u64 = 100 << 20;

#[derive(Deserialize)]
struct Index {
    weight_map: HashMap<String, String>,
}

#[derive(Deserialize)]
struct TensorInfo {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [u64; 2],
}

/// The safetensors files of a model folder: the shards named by
/// `model.safetensors.index.json`, else every `*.safetensors` file.
pub fn files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|source| Error::Io { path: index.clone(), source })?;
        let parsed: Index =
            serde_json::from_str(&text).map_err(|e| Error::Config { path: index.clone(), message: e.to_string() })?;
        let names: BTreeSet<String> = parsed.weight_map.into_values().collect();
        return Ok(names.into_iter().map(|n| dir.join(n)).collect());
    }
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| Error::Io { path: dir.to_path_buf(), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    out.sort();
    if out.is_empty() {
        return Err(Error::Config {
            path: dir.to_path_buf(),
            message: "no *.safetensors weight files in this folder".into(),
        });
    }
    Ok(out)
}

fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// Checks that the header parses and every tensor lies inside the file with the size its
/// dtype and shape imply.
pub fn validate(path: &Path) -> Result<()> {
    let bad = |message: String| Error::Safetensors { path: path.to_path_buf(), message };
    let mut file = std::fs::File::open(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let file_len = file.metadata().map_err(|source| Error::Io { path: path.to_path_buf(), source })?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes).map_err(|_| bad(format!("file is {file_len} bytes, too short for a header")))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > MAX_HEADER_BYTES || header_len + 8 > file_len {
        return Err(bad(format!("header length {header_len} does not fit in a {file_len}-byte file")));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| bad(format!("reading header: {e}")))?;
    let mut entries: HashMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    entries.remove("__metadata__");
    let data_len = file_len - 8 - header_len;
    for (name, value) in entries {
        let info: TensorInfo = serde_json::from_value(value).map_err(|e| bad(format!("tensor {name:?}: {e}")))?;
        let size =
            dtype_size(&info.dtype).ok_or_else(|| bad(format!("tensor {name:?} has unknown dtype {}", info.dtype)))?;
        let [start, end] = info.data_offsets;
        let expected = info.shape.iter().try_fold(size, |acc, &d| acc.checked_mul(d as u64));
        if end < start || Some(end - start) != expected {
            return Err(bad(format!(
                "tensor {name:?} ({} {:?}) spans {} bytes, its shape needs {}",
                info.dtype,
                info.shape,
                end.saturating_sub(start),
                expected.map_or("more than 2^64".to_string(), |e| e.to_string())
            )));
        }
        if end > data_len {
            return Err(bad(format!(
                "tensor {name:?} ends at byte {end} of the data but the file holds only {data_len} (truncated download?)"
            )));
        }
    }
    Ok(())
}

/// Loads every tensor of the folder's safetensors files (lazily, through MLX).
pub fn load(dir: &Path) -> Result<HashMap<String, Array>> {
    let mut tensors = HashMap::new();
    for path in files(dir)? {
        validate(&path)?;
        let loaded = mlx::io::load_safetensors(&path)
            .map_err(|e| Error::Safetensors { path: path.clone(), message: e.to_string() })?;
        tensors.extend(loaded.arrays);
    }
    Ok(tensors)
}
