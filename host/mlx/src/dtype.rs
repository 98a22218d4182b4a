//! Element types, with the codes `cpp/shim.cc` uses.

/// An MLX element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    Bool = 0,
    Uint8 = 1,
    Uint16 = 2,
    Uint32 = 3,
    Uint64 = 4,
    Int8 = 5,
    Int16 = 6,
    Int32 = 7,
    Int64 = 8,
    Float16 = 9,
    Float32 = 10,
    Float64 = 11,
    Bfloat16 = 12,
    Complex64 = 13,
}

impl Dtype {
    pub(crate) fn from_code(code: u8) -> Dtype {
        use Dtype::*;
        match code {
            0 => Bool,
            1 => Uint8,
            2 => Uint16,
            3 => Uint32,
            4 => Uint64,
            5 => Int8,
            6 => Int16,
            7 => Int32,
            8 => Int64,
            9 => Float16,
            10 => Float32,
            11 => Float64,
            12 => Bfloat16,
            13 => Complex64,
            _ => unreachable!("shim returned unknown dtype code {code}"),
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        use Dtype::*;
        match self {
            Bool | Uint8 | Int8 => 1,
            Uint16 | Int16 | Float16 | Bfloat16 => 2,
            Uint32 | Int32 | Float32 => 4,
            Uint64 | Int64 | Float64 | Complex64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Dtype::Float16 | Dtype::Float32 | Dtype::Float64 | Dtype::Bfloat16)
    }

    /// Parses the names used in Hugging Face configs (`float16`, `bfloat16`, `float32`).
    pub fn from_name(name: &str) -> Option<Dtype> {
        match name {
            "float16" | "f16" | "half" => Some(Dtype::Float16),
            "bfloat16" | "bf16" => Some(Dtype::Bfloat16),
            "float32" | "f32" | "float" => Some(Dtype::Float32),
            _ => None,
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = format!("{self:?}").to_lowercase();
        f.write_str(&name)
    }
}
