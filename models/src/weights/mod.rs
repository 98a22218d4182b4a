//! Named weight arrays loaded from a checkpoint, with the lookups the model files use.
//! Formats: `safetensors.rs` (Hugging Face folders), `gguf.rs` (llama.cpp files, read by MLX
//! or, for the K-quants MLX refuses, by `gguf_reader.rs`).

pub mod gguf;
mod gguf_gemma4;
mod gguf_qwen35;
pub mod gguf_reader;
pub mod safetensors;

use crate::{Error, Result};
use mlx::Array;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Quantization parameters of MLX-quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantization {
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
}

impl Quantization {
    /// Affine quantization (MLX's default, with per-group scales and biases).
    pub fn affine(group_size: i32, bits: i32) -> Quantization {
        Quantization { group_size, bits, mode: QuantMode::Affine }
    }

    /// The parameters of MLX's quantized ops, with `biases` (affine mode's; `None` in the others).
    pub fn op<'a>(&self, biases: Option<&'a mlx::Array>) -> mlx::ops::Quant<'a> {
        mlx::ops::Quant { mode: self.mode.name(), group_size: self.group_size, bits: self.bits, biases }
    }
}

/// MLX's quantization modes: `affine` (scales and biases per group) and the microscaling
/// floating-point formats (one shared scale per group, no biases): `mxfp4` (gpt-oss's
/// experts in mlx-community's folders), `mxfp8`, `nvfp4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMode {
    Affine,
    Mxfp4,
    Mxfp8,
    Nvfp4,
}

impl QuantMode {
    pub const NAMES: &'static str = "affine, mxfp4, mxfp8, nvfp4";

    pub fn parse(name: &str) -> Option<QuantMode> {
        Some(match name {
            "affine" => QuantMode::Affine,
            "mxfp4" => QuantMode::Mxfp4,
            "mxfp8" => QuantMode::Mxfp8,
            "nvfp4" => QuantMode::Nvfp4,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Mxfp8 => "mxfp8",
            QuantMode::Nvfp4 => "nvfp4",
        }
    }

    /// Whether each group has a bias next to its scale (`{prefix}.biases`).
    pub fn has_biases(self) -> bool {
        self == QuantMode::Affine
    }
}

/// All weights of a checkpoint by name, plus where they came from (for error messages).
#[derive(Clone)]
pub struct Weights {
    tensors: HashMap<String, Array>,
    path: PathBuf,
    arch: String,
    /// Default quantization of `*.scales`/`*.biases` weights, and per-module overrides.
    quantization: Option<Quantization>,
    overrides: HashMap<String, Option<Quantization>>,
}

impl Weights {
    pub fn new(tensors: HashMap<String, Array>, path: &Path, arch: &str) -> Weights {
        Weights {
            tensors,
            path: path.to_path_buf(),
            arch: arch.to_string(),
            quantization: None,
            overrides: HashMap::new(),
        }
    }

    pub fn with_quantization(
        mut self,
        q: Option<Quantization>,
        overrides: HashMap<String, Option<Quantization>>,
    ) -> Weights {
        self.quantization = q;
        self.overrides = overrides;
        self
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.tensors.keys()
    }

    pub fn remove(&mut self, name: &str) -> Option<Array> {
        self.tensors.remove(name)
    }

    pub fn insert(&mut self, name: String, a: Array) {
        self.tensors.insert(name, a);
    }

    /// Keeps part `index` of `parts` equal parts of weight `name` along `axis` (a tensor-parallel
    /// shard), as a copy, so the whole tensor is freed once the shard is read.
    pub fn shard(&mut self, name: &str, axis: usize, parts: usize, index: usize) -> Result<()> {
        let a = self.get(name)?;
        let n = a.dim(axis as i32);
        if n % parts != 0 {
            return Err(Error::Invalid(format!(
                "cannot split {name} ({:?}) into {parts} equal parts along axis {axis}",
                a.shape()
            )));
        }
        let len = (n / parts) as i32;
        let part = a.slice_axis(axis as i32, len * index as i32, len * (index as i32 + 1))?.copy()?;
        self.tensors.insert(name.to_string(), part);
        Ok(())
    }

    /// Concatenates modules `parts` (one input width, one dtype, one quantization) along their
    /// output rows into module `into`: the weight, and the scales, biases and bias where the
    /// parts have them. The result is evaluated at once and the parts removed, so loading
    /// holds at most one extra copy of these modules. Returns false, changing nothing, when
    /// the parts differ in quantization, dtype, input width or which arrays they carry, or a
    /// part's weight does not have its expected `rows`: loading the parts separately then
    /// names the misfit.
    pub fn fuse_rows(&mut self, parts: &[String], rows: &[usize], into: &str) -> Result<bool> {
        const ARRAYS: [&str; 4] = ["weight", "scales", "biases", "bias"];
        let q = self.quantization_of(&parts[0])?;
        let has = |w: &Weights, p: &str| -> Vec<&'static str> {
            ARRAYS.into_iter().filter(|s| w.contains(&format!("{p}.{s}"))).collect()
        };
        let suffixes = has(self, &parts[0]);
        if !suffixes.contains(&"weight") {
            return Ok(false); // missing: loading the parts names the weight
        }
        let cols = self.get(&format!("{}.weight", parts[0]))?.dim(1);
        for (p, &n) in parts.iter().zip(rows) {
            let shape = self.get(&format!("{p}.weight"))?.shape();
            if self.quantization_of(p)? != q || has(self, p) != suffixes || shape != [n, cols] {
                return Ok(false);
            }
        }
        let mut fused = Vec::new();
        for s in &suffixes {
            let arrays: Vec<Array> = parts.iter().map(|p| self.get(&format!("{p}.{s}"))).collect::<Result<_>>()?;
            if arrays.iter().any(|a| a.dtype() != arrays[0].dtype()) {
                return Ok(false);
            }
            let refs: Vec<&Array> = arrays.iter().collect();
            fused.push((format!("{into}.{s}"), mlx::ops::concatenate(&refs, 0)?));
        }
        let refs: Vec<&Array> = fused.iter().map(|(_, a)| a).collect();
        mlx::eval(&refs).map_err(|e| Error::Invalid(format!("reading weights from {}: {e}", self.path.display())))?;
        for p in parts {
            for s in &suffixes {
                self.tensors.remove(&format!("{p}.{s}"));
            }
        }
        if q.is_some() {
            self.overrides.insert(into.to_string(), q);
        }
        self.tensors.extend(fused);
        Ok(true)
    }

    /// Evaluates (reads, converts) every weight.
    pub fn eval(&self) -> Result<()> {
        let all: Vec<&Array> = self.tensors.values().collect();
        for chunk in all.chunks(64) {
            mlx::eval(chunk)
                .map_err(|e| Error::Invalid(format!("reading weights from {}: {e}", self.path.display())))?;
        }
        Ok(())
    }

    /// Total bytes of all weights (what one decode step reads, for dense models).
    pub fn nbytes(&self) -> usize {
        self.tensors.values().map(|a| a.nbytes()).sum()
    }

    /// The weight `name`, or an error that names it and the file.
    pub fn get(&self, name: &str) -> Result<Array> {
        self.tensors.get(name).cloned().ok_or_else(|| Error::MissingWeight {
            name: name.to_string(),
            path: self.path.clone(),
            arch: self.arch.clone(),
        })
    }

    /// The weight `name`, checked to have `shape`.
    pub fn get_shaped(&self, name: &str, shape: &[usize]) -> Result<Array> {
        let a = self.get(name)?;
        let found = a.shape();
        if found != shape {
            return Err(Error::WeightShape {
                name: name.to_string(),
                path: self.path.clone(),
                found,
                expected: shape.to_vec(),
            });
        }
        Ok(a)
    }

    /// Sets module `prefix`'s quantization (a module made at load, like stacked experts).
    pub fn set_quantization(&mut self, prefix: &str, q: Option<Quantization>) {
        self.overrides.insert(prefix.to_string(), q);
    }

    /// The quantization of module `prefix`, if its weight is quantized.
    pub fn quantization_of(&self, prefix: &str) -> Result<Option<Quantization>> {
        if !self.contains(&format!("{prefix}.scales")) {
            return Ok(None);
        }
        let q = match self.overrides.get(prefix) {
            Some(q) => *q,
            None => self.quantization,
        };
        match q {
            Some(q) => Ok(Some(q)),
            None => Err(Error::Config {
                path: self.path.clone(),
                message: format!("{prefix}.scales is present but config.json has no `quantization` section giving group_size and bits"),
            }),
        }
    }
}

/// 0, 1, 2, ... in `shape` (float32): a tensor whose values say where they came from, for the
/// loaders' tests.
#[cfg(test)]
pub(crate) fn arange(shape: &[usize]) -> Array {
    let n: usize = shape.iter().product();
    Array::from_f32(&(0..n).map(|i| i as f32).collect::<Vec<_>>(), shape).unwrap()
}
