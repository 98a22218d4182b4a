//! Reading and writing weight files with MLX's own readers.

use crate::array::wrap;
use crate::ffi::ffi;
use crate::{Array, Error, Result};
use std::collections::HashMap;
use std::path::Path;

/// One metadata value of a GGUF file.
#[derive(Debug, Clone)]
pub enum GgufValue {
    /// Numbers (scalars are 0-d or 1-element arrays).
    Array(Array),
    String(String),
    Strings(Vec<String>),
}

/// Arrays by name, plus the file's metadata.
#[derive(Debug, Default)]
pub struct Tensors {
    pub arrays: HashMap<String, Array>,
    /// Safetensors `__metadata__` strings.
    pub metadata: HashMap<String, String>,
    /// GGUF key/value metadata.
    pub gguf: HashMap<String, GgufValue>,
}

fn path_str(path: &Path) -> Result<&str> {
    path.to_str().ok_or_else(|| Error::Invalid(format!("path {} is not UTF-8", path.display())))
}

fn arrays_of(loaded: &ffi::Loaded) -> Result<HashMap<String, Array>> {
    let mut arrays = HashMap::new();
    for i in 0..ffi::loaded_len(loaded) {
        arrays.insert(ffi::loaded_name(loaded, i)?, wrap(ffi::loaded_array(loaded, i))?);
    }
    Ok(arrays)
}

/// Reads a `.safetensors` file lazily (arrays load on first use).
pub fn load_safetensors(path: &Path) -> Result<Tensors> {
    let loaded = ffi::load_safetensors(path_str(path)?)?;
    let arrays = arrays_of(&loaded)?;
    let mut metadata = HashMap::new();
    for key in ffi::loaded_meta_keys(&loaded) {
        metadata.insert(key.clone(), ffi::loaded_meta_string(&loaded, &key)?);
    }
    Ok(Tensors { arrays, metadata, gguf: HashMap::new() })
}

/// Reads a `.gguf` file. Quantized tensors come back as MLX affine triples
/// (`name`, `name`→`scales`, `name`→`biases`, see MLX's `load_gguf`).
pub fn load_gguf(path: &Path) -> Result<Tensors> {
    let loaded = ffi::load_gguf(path_str(path)?)?;
    let arrays = arrays_of(&loaded)?;
    let mut gguf = HashMap::new();
    for key in ffi::loaded_meta_keys(&loaded) {
        let value = match ffi::loaded_meta_kind(&loaded, &key) {
            1 => GgufValue::Array(wrap(ffi::loaded_meta_array(&loaded, &key))?),
            2 => GgufValue::String(ffi::loaded_meta_string(&loaded, &key)?),
            3 => GgufValue::Strings(ffi::loaded_meta_strings(&loaded, &key)?),
            _ => continue,
        };
        gguf.insert(key, value);
    }
    Ok(Tensors { arrays, metadata: HashMap::new(), gguf })
}

/// Writes arrays (and string metadata) as a `.safetensors` file.
pub fn save_safetensors(path: &Path, arrays: &[(&str, &Array)]) -> Result<()> {
    let mut loaded = ffi::loaded_new();
    for (name, a) in arrays {
        ffi::loaded_push(loaded.pin_mut(), name, &a.0);
    }
    Ok(ffi::save_safetensors(path_str(path)?, &loaded)?)
}

/// Writes arrays and GGUF metadata as a `.gguf` file (float tensors only).
pub fn save_gguf(path: &Path, arrays: &[(&str, &Array)], metadata: &[(&str, GgufValue)]) -> Result<()> {
    let mut loaded = ffi::loaded_new();
    for (name, a) in arrays {
        ffi::loaded_push(loaded.pin_mut(), name, &a.0);
    }
    for (key, value) in metadata {
        match value {
            GgufValue::Array(a) => ffi::loaded_push_meta_array(loaded.pin_mut(), key, &a.0),
            GgufValue::String(s) => ffi::loaded_push_meta_string(loaded.pin_mut(), key, s),
            GgufValue::Strings(v) => ffi::loaded_push_meta_strings(loaded.pin_mut(), key, v),
        }
    }
    Ok(ffi::save_gguf(path_str(path)?, &loaded)?)
}
