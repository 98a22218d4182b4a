//! A GGUF reader of our own, for the files MLX's reader refuses: the K-quants (Q2_K to Q8_K)
//! that most files on the model hubs use, mixed with Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, F16, BF16 and
//! F32 tensors as llama.cpp writes them. Every tensor is dequantized to float32, block by block,
//! in the order and float32 arithmetic of ggml's `dequantize_row_*` (checked value for value
//! against gguf-py's dequantization in `tests::k_quants_match_gguf_py`).
//!
//! Layout (GGUF v2/v3): the magic `GGUF`, the version, the tensor and metadata counts, the
//! metadata (typed key/values), the tensor infos (name, dims in ggml order, type, offset),
//! then the data, aligned to `general.alignment` (default 32).

use crate::{Error, Result};
use mlx::io::GgufValue;
use mlx::Array;
use std::collections::HashMap;
use std::path::Path;

/// ggml tensor types this reader knows: (id, name, elements per block, bytes per block).
const TYPES: &[(u32, &str, usize, usize)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (30, "BF16", 1, 2),
];

/// Types MLX's own reader loads (it keeps Q4_0/Q4_1/Q8_0 quantized, in its affine layout).
pub const MLX_READS: &[u32] = &[0, 1, 2, 3, 8];

/// One tensor's entry in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Row-major shape (GGUF stores the dims fastest-varying first; this is reversed).
    pub shape: Vec<usize>,
    pub kind: u32,
    /// Offset of its data from the start of the file.
    pub start: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The type's name, for messages.
    pub fn kind_name(&self) -> String {
        TYPES.iter().find(|t| t.0 == self.kind).map_or_else(|| format!("type {}", self.kind), |t| t.1.to_string())
    }
}

/// A GGUF file's metadata and tensor table.
pub struct Header {
    pub metadata: HashMap<String, GgufValue>,
    pub tensors: Vec<TensorInfo>,
}

impl Header {
    /// Whether MLX's own reader can load every tensor (it keeps Q4_0/Q4_1/Q8_0 quantized).
    pub fn mlx_reads_all(&self) -> bool {
        self.tensors.iter().all(|t| MLX_READS.contains(&t.kind))
    }
}

/// A whole GGUF file: its header and its bytes.
pub struct GgufFile {
    pub header: Header,
    bytes: Vec<u8>,
}

/// Why parsing stopped: the bytes read so far end inside the header, or the file is bad.
enum Stop {
    Short,
    Bad(String),
}

type Parsed<T> = std::result::Result<T, Stop>;

/// A reader over the first bytes of a file of `file_len` bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    file_len: usize,
}

fn bad<T>(message: impl Into<String>) -> Parsed<T> {
    Err(Stop::Bad(message.into()))
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Parsed<&'a [u8]> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.bytes.len() => {
                let out = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(out)
            }
            Some(end) if end <= self.file_len => Err(Stop::Short),
            _ => bad(format!("the file ends inside its header (at byte {}); is it complete?", self.pos)),
        }
    }
    fn u32(&mut self) -> Parsed<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Parsed<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    fn count(&mut self, what: &str) -> Parsed<usize> {
        let n = self.u64()?;
        // Each entry takes at least a byte: a count past the file's size is corruption.
        if n > self.file_len as u64 {
            return bad(format!("a {what} of {n} is larger than the file"));
        }
        Ok(n as usize)
    }
    fn string(&mut self) -> Parsed<String> {
        let n = self.count("string length")?;
        String::from_utf8(self.take(n)?.to_vec()).or_else(|_| bad("a metadata string is not UTF-8"))
    }

    /// One metadata value of type `t` (GGUF's type codes).
    fn value(&mut self, t: u32) -> Parsed<Value> {
        let number = Value::Number;
        Ok(match t {
            0 => number(self.take(1)?[0] as f64),
            1 => number(self.take(1)?[0] as i8 as f64),
            2 => number(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as f64),
            3 => number(i16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")) as f64),
            4 => number(self.u32()? as f64),
            5 => number(self.u32()? as i32 as f64),
            6 => number(f32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as f64),
            7 => number(self.take(1)?[0] as f64),
            8 => Value::String(self.string()?),
            9 => {
                let inner = self.u32()?;
                let n = self.count("array length")?;
                Value::List((0..n).map(|_| self.value(inner)).collect::<Parsed<_>>()?)
            }
            10 => number(self.u64()? as f64),
            11 => number(self.u64()? as i64 as f64),
            12 => number(f64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"))),
            other => return bad(format!("unknown metadata value type {other}")),
        })
    }
}

/// A metadata value as read, before it becomes a `GgufValue` like MLX's reader gives.
enum Value {
    Number(f64),
    String(String),
    List(Vec<Value>),
}

impl Value {
    fn into_gguf(self) -> Result<GgufValue> {
        Ok(match self {
            Value::Number(v) => GgufValue::Array(number_array(&[v])?),
            Value::String(s) => GgufValue::String(s),
            Value::List(items) if !items.is_empty() && items.iter().all(|i| matches!(i, Value::String(_))) => {
                GgufValue::Strings(
                    items.into_iter().filter_map(|i| if let Value::String(s) = i { Some(s) } else { None }).collect(),
                )
            }
            Value::List(items) => {
                let numbers: Vec<f64> =
                    items.iter().filter_map(|i| if let Value::Number(v) = i { Some(*v) } else { None }).collect();
                GgufValue::Array(number_array(&numbers)?)
            }
        })
    }
}

/// Numbers as MLX's reader gives them: integers as int32 (token ids, types), others float32.
fn number_array(values: &[f64]) -> Result<Array> {
    let integral = values.iter().all(|v| v.fract() == 0.0 && v.abs() <= i32::MAX as f64);
    Ok(if integral {
        Array::from_i32(&values.iter().map(|&v| v as i32).collect::<Vec<_>>(), &[values.len()])?
    } else {
        Array::from_f32(&values.iter().map(|&v| v as f32).collect::<Vec<_>>(), &[values.len()])?
    })
}

/// Parses the header from the file's first bytes (`file_len` in all).
fn parse(prefix: &[u8], file_len: usize) -> Parsed<(Vec<(String, Value)>, Vec<TensorInfo>)> {
    let mut c = Cursor { bytes: prefix, pos: 0, file_len };
    if c.take(4)? != b"GGUF" {
        return bad("not a GGUF file (it does not start with \"GGUF\")");
    }
    let version = c.u32()?;
    if !(2..=3).contains(&version) {
        return bad(format!("GGUF version {version} is not supported (2 and 3 are)"));
    }
    let n_tensors = c.count("tensor count")?;
    let n_meta = c.count("metadata count")?;
    let mut metadata = Vec::with_capacity(n_meta);
    let mut alignment = 32usize;
    for _ in 0..n_meta {
        let key = c.string()?;
        let t = c.u32()?;
        let value = c.value(t)?;
        if key == "general.alignment" {
            alignment = if let Value::Number(a) = value { a as usize } else { 0 };
            if alignment == 0 || !alignment.is_power_of_two() {
                return bad(format!("general.alignment {alignment} is not a power of two"));
            }
            continue;
        }
        metadata.push((key, value));
    }
    let mut infos = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string()?;
        let n_dims = c.u32()? as usize;
        if n_dims > 8 {
            return bad(format!("tensor {name:?} has {n_dims} dimensions"));
        }
        let mut shape: Vec<usize> = (0..n_dims).map(|_| c.u64().map(|d| d as usize)).collect::<Parsed<_>>()?;
        shape.reverse();
        let kind = c.u32()?;
        let offset = c.u64()? as usize;
        infos.push((name, shape, kind, offset));
    }
    let data = c.pos.div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(n_tensors);
    for (name, shape, kind, offset) in infos {
        let Some(&(_, type_name, block, block_bytes)) = TYPES.iter().find(|t| t.0 == kind) else {
            return bad(format!(
                "tensor {name:?} has ggml type {kind}, which this reader does not know (it reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q8_K)"
            ));
        };
        let info = TensorInfo { name, shape, kind, start: data.saturating_add(offset) };
        let row = info.shape.last().copied().unwrap_or(1);
        if row % block != 0 {
            return bad(format!(
                "tensor {:?} ({type_name}) has rows of {row} values, not a multiple of its block of {block}",
                info.name
            ));
        }
        let size = info.elements().checked_mul(block_bytes).map(|b| b / block);
        if size.and_then(|s| info.start.checked_add(s)).is_none_or(|end| end > file_len) {
            return bad(format!("tensor {:?} runs past the end of the file; is it complete?", info.name));
        }
        tensors.push(info);
    }
    Ok((metadata, tensors))
}

fn header_of(parsed: (Vec<(String, Value)>, Vec<TensorInfo>)) -> Result<Header> {
    let (metadata, tensors) = parsed;
    let metadata = metadata.into_iter().map(|(k, v)| Ok((k, v.into_gguf()?))).collect::<Result<_>>()?;
    Ok(Header { metadata, tensors })
}

/// Reads only the header (growing reads from the start of the file until it is complete).
pub fn header(path: &Path) -> Result<Header> {
    use std::io::Read;
    let err = |message: String| Error::Gguf { path: path.to_path_buf(), message };
    let mut file = std::fs::File::open(path).map_err(|e| err(format!("cannot read it: {e}")))?;
    let file_len = file.metadata().map_err(|e| err(format!("cannot read it: {e}")))?.len() as usize;
    let mut prefix = Vec::new();
    let mut want = 1 << 20;
    loop {
        let more = want.min(file_len) - prefix.len();
        (&mut file).take(more as u64).read_to_end(&mut prefix).map_err(|e| err(format!("cannot read it: {e}")))?;
        match parse(&prefix, file_len) {
            Ok(parsed) => return header_of(parsed),
            Err(Stop::Short) if prefix.len() < file_len => want *= 4,
            Err(Stop::Short) => return Err(err("the file ends inside its header; is it complete?".into())),
            Err(Stop::Bad(message)) => return Err(err(message)),
        }
    }
}

impl GgufFile {
    /// Reads the whole file: its header is parsed and checked (every tensor's data inside
    /// the file, every type known); tensors are dequantized on demand.
    pub fn read(path: &Path) -> Result<GgufFile> {
        let err = |message: String| Error::Gguf { path: path.to_path_buf(), message };
        let bytes = std::fs::read(path).map_err(|e| err(format!("cannot read it: {e}")))?;
        let header = match parse(&bytes, bytes.len()) {
            Ok(parsed) => header_of(parsed)?,
            Err(Stop::Short) => return Err(err("the file ends inside its header; is it complete?".into())),
            Err(Stop::Bad(message)) => return Err(err(message)),
        };
        Ok(GgufFile { header, bytes })
    }

    /// A tensor's values as float32, in row-major order.
    pub fn dequantize(&self, info: &TensorInfo) -> Vec<f32> {
        let mut out = Vec::with_capacity(info.elements());
        for b in self.blocks(info) {
            dequantize_block(info.kind, b, &mut out);
        }
        out
    }

    /// A tensor's data, block by block.
    fn blocks(&self, info: &TensorInfo) -> std::slice::ChunksExact<'_, u8> {
        let (_, _, block, block_bytes) = *TYPES.iter().find(|t| t.0 == info.kind).expect("checked at read");
        let end = info.start + info.elements() / block * block_bytes;
        self.bytes[info.start..end].chunks_exact(block_bytes)
    }
}

/// A tensor's values in MLX's affine layout, group 32: packed codes (`bits` 4 or 8, the
/// lowest bits first, as `mlx.quantize` packs), and a float32 scale and bias per 32 values.
pub struct Affine {
    pub codes: Vec<u32>,
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
    pub bits: usize,
}

impl GgufFile {
    /// `info` in MLX's affine layout where its blocks are affine per 32 values already, so
    /// that `scale * code + bias` gives exactly `dequantize`'s values: Q4_0 (bias -8d),
    /// Q4_1, Q8_0 (codes + 128, bias -128d) and Q4_K (each 32-value sub-block's 6-bit scale
    /// and min times the block's d and dmin). None for other types and for tensors that are
    /// not matrices.
    pub fn affine(&self, info: &TensorInfo) -> Option<Affine> {
        let bits = match info.kind {
            2 | 3 | 12 => 4,
            // Five-bit codes (Q5_0, Q5_1, Q5_K) as eight-bit ones: the same values exactly.
            6 | 7 | 8 | 13 => 8,
            _ => return None,
        };
        if info.shape.len() != 2 || !info.shape[1].is_multiple_of(32) {
            return None;
        }
        let n = info.elements();
        let (mut codes, mut scales, mut biases) = (Vec::with_capacity(n * bits / 32), Vec::new(), Vec::new());
        // One group of 32 codes, packed lowest bits first, with its scale and bias.
        let mut group = |values: [u8; 32], scale: f32, bias: f32| {
            for word in values.chunks_exact(32 / bits) {
                codes.push(word.iter().enumerate().fold(0u32, |w, (i, &c)| w | (c as u32) << (bits * i)));
            }
            scales.push(scale);
            biases.push(bias);
        };
        let nibbles =
            |q: &[u8], high: bool| -> [u8; 16] { std::array::from_fn(|i| if high { q[i] >> 4 } else { q[i] & 0xf }) };
        let concat =
            |a: [u8; 16], b: [u8; 16]| -> [u8; 32] { std::array::from_fn(|i| if i < 16 { a[i] } else { b[i - 16] }) };
        for b in self.blocks(info) {
            match info.kind {
                2 | 3 => {
                    let (d, qs) = (f16(b), &b[if info.kind == 2 { 2 } else { 4 }..][..16]);
                    let bias = if info.kind == 2 { -8.0 * d } else { f16(&b[2..]) };
                    group(concat(nibbles(qs, false), nibbles(qs, true)), d, bias);
                }
                6 | 7 => {
                    // d, (m,) qh (the codes' fifth bits), qs: code j's low nibble in qs[j % 16].
                    let (d, rest) = if info.kind == 6 { (f16(b), &b[2..]) } else { (f16(b), &b[4..]) };
                    let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                    let qs = &rest[4..20];
                    let code = |j: usize| {
                        let low = if j < 16 { qs[j] & 0xf } else { qs[j - 16] >> 4 };
                        low | (((qh >> j) & 1) << 4) as u8
                    };
                    let bias = if info.kind == 6 { -16.0 * d } else { f16(&b[2..]) };
                    group(std::array::from_fn(code), d, bias);
                }
                8 => {
                    let d = f16(b);
                    group(std::array::from_fn(|i| (b[2 + i] as i8 as i16 + 128) as u8), d, -128.0 * d);
                }
                _ => {
                    // Q4_K: d, dmin, scales[12], qs[128]; Q5_K: qh[32] (the fifth bits) before qs.
                    let (d, min, sc) = (f16(b), f16(&b[2..]), &b[4..16]);
                    let (qh, ql) = if info.kind == 12 { (None, &b[16..144]) } else { (Some(&b[16..48]), &b[48..176]) };
                    for chunk in 0..4 {
                        let q = &ql[chunk * 32..chunk * 32 + 32];
                        for (sub, high) in [(chunk * 2, false), (chunk * 2 + 1, true)] {
                            let (s, m) = scale_min_k4(sub, sc);
                            let codes = match qh {
                                None => concat(nibbles(&q[..16], high), nibbles(&q[16..], high)),
                                Some(h) => std::array::from_fn(|l| {
                                    let low = if high { q[l] >> 4 } else { q[l] & 0xf };
                                    low | if h[l] & (1 << sub) != 0 { 16 } else { 0 }
                                }),
                            };
                            group(codes, d * s, -(min * m));
                        }
                    }
                }
            }
        }
        Some(Affine { codes, scales, biases, bits })
    }
}

fn f16(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// IEEE half to single precision, exactly (subnormals, infinities and NaN included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let frac = (h & 0x3ff) as u32;
    let bits = match (exp, frac) {
        (0, 0) => sign,
        (0, f) => {
            // Subnormal: normalize.
            let shift = f.leading_zeros() - 21;
            sign | ((113 - shift) << 23) | ((f << shift) & 0x3ff) << 13
        }
        (0x1f, f) => sign | 0x7f80_0000 | (f << 13),
        (e, f) => sign | ((e + 112) << 23) | (f << 13),
    };
    f32::from_bits(bits)
}

/// Q4_K and Q5_K's 6-bit scale and min of sub-block `j` (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (d, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    };
    (d as f32, m as f32)
}

/// Appends one block's values to `out`, as ggml's `dequantize_row_*` computes them.
fn dequantize_block(kind: u32, b: &[u8], out: &mut Vec<f32>) {
    match kind {
        0 => out.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        1 => out.push(f16(b)),
        30 => out.push(f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)),
        2 => {
            let (d, qs) = (f16(b), &b[2..18]);
            out.extend(qs.iter().map(|&q| ((q & 0xf) as i32 - 8) as f32 * d));
            out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
        }
        3 => {
            let (d, m, qs) = (f16(b), f16(&b[2..]), &b[4..20]);
            out.extend(qs.iter().map(|&q| (q & 0xf) as f32 * d + m));
            out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
        }
        6 | 7 => {
            let (d, m, rest) = if kind == 6 { (f16(b), 0.0, &b[2..]) } else { (f16(b), f16(&b[2..]), &b[4..]) };
            let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            let qs = &rest[4..20];
            let offset = if kind == 6 { 16 } else { 0 };
            let value = |q: u8, high: u32| ((q as u32 | high) as i32 - offset) as f32;
            let one = |x: f32| if kind == 6 { x * d } else { x * d + m };
            out.extend((0..16).map(|j| one(value(qs[j] & 0xf, ((qh >> j) << 4) & 0x10))));
            out.extend((0..16).map(|j| one(value(qs[j] >> 4, (qh >> (j + 12)) & 0x10))));
        }
        8 => {
            let d = f16(b);
            out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
        }
        10 => {
            // Q2_K: scales[16], qs[64], d, dmin.
            let (scales, qs, d, min) = (&b[0..16], &b[16..80], f16(&b[80..]), f16(&b[82..]));
            let mut is = 0;
            for half in 0..2 {
                let q = &qs[half * 32..half * 32 + 32];
                for shift in [0, 2, 4, 6] {
                    for part in 0..2 {
                        let sc = scales[is];
                        is += 1;
                        let (dl, ml) = (d * (sc & 0xf) as f32, min * (sc >> 4) as f32);
                        out.extend(q[part * 16..part * 16 + 16].iter().map(|&x| dl * ((x >> shift) & 3) as f32 - ml));
                    }
                }
            }
        }
        11 => {
            // Q3_K: hmask[32], qs[64], scales[12], d.
            let (hmask, qs, packed, d_all) = (&b[0..32], &b[32..96], &b[96..108], f16(&b[108..]));
            let word =
                |i: usize| u32::from_le_bytes([packed[i * 4], packed[i * 4 + 1], packed[i * 4 + 2], packed[i * 4 + 3]]);
            let (k1, k2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
            let (a0, a1, tmp) = (word(0), word(1), word(2));
            let aux = [
                (a0 & k2) | ((tmp & k1) << 4),
                (a1 & k2) | (((tmp >> 2) & k1) << 4),
                ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
                ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
            ];
            let scales: Vec<i8> = aux.iter().flat_map(|w| w.to_le_bytes()).map(|x| x as i8).collect();
            let (mut is, mut m) = (0, 1u8);
            for half in 0..2 {
                let q = &qs[half * 32..half * 32 + 32];
                for shift in [0, 2, 4, 6] {
                    for part in 0..2 {
                        let dl = d_all * (scales[is] as i32 - 32) as f32;
                        is += 1;
                        out.extend((part * 16..part * 16 + 16).map(|l| {
                            let low = ((q[l] >> shift) & 3) as i32;
                            dl * (low - if hmask[l] & m != 0 { 0 } else { 4 }) as f32
                        }));
                    }
                    m <<= 1;
                }
            }
        }
        12 | 13 => {
            // Q4_K: d, dmin, scales[12], qs[128]; Q5_K adds qh[32] before qs.
            let (d, min, scales) = (f16(b), f16(&b[2..]), &b[4..16]);
            let (qh, ql) = if kind == 12 { (None, &b[16..144]) } else { (Some(&b[16..48]), &b[48..176]) };
            for chunk in 0..4 {
                let (sc1, m1) = scale_min_k4(chunk * 2, scales);
                let (sc2, m2) = scale_min_k4(chunk * 2 + 1, scales);
                let (d1, m1, d2, m2) = (d * sc1, min * m1, d * sc2, min * m2);
                let q = &ql[chunk * 32..chunk * 32 + 32];
                let (u1, u2) = (1u8 << (2 * chunk), 2u8 << (2 * chunk));
                let high = |l: usize, u: u8| qh.map_or(0.0, |h| if h[l] & u != 0 { 16.0 } else { 0.0 });
                out.extend((0..32).map(|l| d1 * ((q[l] & 0xf) as f32 + high(l, u1)) - m1));
                out.extend((0..32).map(|l| d2 * ((q[l] >> 4) as f32 + high(l, u2)) - m2));
            }
        }
        14 => {
            // Q6_K: ql[128], qh[64], scales[16] (int8), d.
            let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], f16(&b[208..]));
            for half in 0..2 {
                let (ql, qh, sc) = (&ql[half * 64..], &qh[half * 32..], &sc[half * 8..]);
                let mut y = [0f32; 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
                out.extend_from_slice(&y);
            }
        }
        15 => {
            let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            out.extend(b[4..260].iter().map(|&q| d * q as i8 as f32));
        }
        _ => unreachable!("types are checked when the file is read"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// tests/fixtures/make-kquant-gguf.py's files (scripts/test-fixtures.sh makes them).
    fn fixture() -> Option<PathBuf> {
        let dir = PathBuf::from(std::env::var_os("HOST_TEST_MODELS")?).join("kquants");
        if dir.join("kquants.gguf").is_file() {
            Some(dir)
        } else {
            eprintln!("skipped: no {}/kquants.gguf (run scripts/test-fixtures.sh)", dir.display());
            None
        }
    }

    /// Every type, dequantized here, equals gguf-py's dequantization within 1e-6.
    #[test]
    fn k_quants_match_gguf_py() {
        let Some(dir) = fixture() else { return };
        let raw = GgufFile::read(&dir.join("kquants.gguf")).unwrap();
        let expected = GgufFile::read(&dir.join("kquants-expected.gguf")).unwrap();
        assert!(!raw.header.mlx_reads_all(), "a mixed file MLX's reader refuses");
        let mut seen = Vec::new();
        for t in &raw.header.tensors {
            let e = expected.header.tensors.iter().find(|x| x.name == t.name).unwrap();
            assert_eq!((e.kind, &e.shape), (0, &t.shape), "{}", t.name);
            let (got, want) = (raw.dequantize(t), expected.dequantize(e));
            assert_eq!(got.len(), want.len());
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1.0)).fold(0f32, f32::max);
            assert!(worst <= 1e-6, "{} ({}) differs from gguf-py by {worst}", t.name, t.kind_name());
            assert!(want.iter().any(|&v| v != 0.0), "{}", t.name);
            seen.push(t.kind_name());
        }
        let want = [
            "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "Q8_K",
        ];
        assert_eq!(seen, want);
        // The header alone gives the same table.
        let header = header(&dir.join("kquants.gguf")).unwrap();
        assert_eq!(header.tensors.len(), 14);
        assert_eq!(header.tensors[13].start, raw.header.tensors[13].start);
    }

    /// Q4_0, Q4_1, Q8_0 and Q4_K repacked into MLX's affine layout give, as `scale * code +
    /// bias` (MLX's dequantization), exactly the values `dequantize` gives; other types are not
    /// repacked.
    #[test]
    fn affine_blocks_repack_exactly() {
        let Some(dir) = fixture() else { return };
        let raw = GgufFile::read(&dir.join("kquants.gguf")).unwrap();
        let mut packed = Vec::new();
        for t in &raw.header.tensors {
            let Some(a) = raw.affine(t) else { continue };
            let want = raw.dequantize(t);
            let per_word = 32 / a.bits;
            let mask = (1u32 << a.bits) - 1;
            let got: Vec<f32> = (0..want.len())
                .map(|i| {
                    let code = (a.codes[i / per_word] >> (a.bits * (i % per_word))) & mask;
                    a.scales[i / 32] * code as f32 + a.biases[i / 32]
                })
                .collect();
            assert_eq!(a.codes.len(), want.len() * a.bits / 32, "{}", t.name);
            // Equal as numbers: Q4_0's code 8 gives +0 where ggml's (8 - 8) * d gives -0 for d < 0.
            let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
            assert_eq!(differ, 0, "{} ({}): {differ} values differ", t.name, t.kind_name());
            packed.push(t.kind_name());
        }
        assert_eq!(packed, ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"]);
    }

    #[test]
    fn damaged_files_are_clear_errors() {
        let Some(dir) = fixture() else { return };
        let bytes = std::fs::read(dir.join("kquants.gguf")).unwrap();
        let tmp = std::env::temp_dir().join(format!("kquants-damaged-{}.gguf", std::process::id()));
        let message = |bytes: &[u8]| {
            std::fs::write(&tmp, bytes).unwrap();
            let e = header(&tmp).err().map(|e| e.to_string()).unwrap_or_default();
            let f = GgufFile::read(&tmp).err().map(|e| e.to_string()).unwrap_or_default();
            assert_eq!(e, f);
            e
        };
        assert!(message(&bytes[..bytes.len() - 100]).contains("runs past the end of the file"));
        assert!(message(&bytes[..200]).contains("ends inside its header"));
        assert!(message(b"GGML1234").contains("not a GGUF file"));
        // The first tensor's type (F32, 0) becomes 99.
        let info = bytes.windows(5).position(|w| w == b"t.F32").unwrap() + 5 + 4 + 16;
        let mut unknown = bytes.clone();
        unknown[info..info + 4].copy_from_slice(&99u32.to_le_bytes());
        assert!(message(&unknown).contains("ggml type 99"));
        std::fs::remove_file(&tmp).unwrap();
    }

    #[test]
    fn half_precision_converts_exactly() {
        for (bits, value) in [
            (0x3c00u16, 1.0f32),
            (0xc000, -2.0),
            (0x7bff, 65504.0),
            (0x0001, 2f32.powi(-24)),
            (0x03ff, 1023.0 * 2f32.powi(-24)),
            (0x0400, 2f32.powi(-14)),
            (0x8000, -0.0),
            (0x7c00, f32::INFINITY),
        ] {
            assert_eq!(f16_to_f32(bits).to_bits(), value.to_bits(), "{bits:#06x}");
        }
        assert!(f16_to_f32(0x7e00).is_nan());
    }
}
