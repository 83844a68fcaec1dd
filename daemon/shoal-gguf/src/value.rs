//! GGUF metadata values: the typed key/value pairs in a file's header.

/// A metadata value type, with the id the file stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type with this id.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The fewest bytes one value of this type takes in a file (a string: its length).
    pub fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value. Strings are kept as raw bytes so a shard copies them exactly.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(Vec<u8>),
    /// Element type and elements (all of that type; GGUF has no nested arrays here).
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as text, if it is a UTF-8 string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// The same value converted to `ty` (an integer type), when it fits.
    pub fn integer_as(v: u64, ty: ValueType) -> Option<Value> {
        Some(match ty {
            ValueType::U8 => Value::U8(v.try_into().ok()?),
            ValueType::I8 => Value::I8(v.try_into().ok()?),
            ValueType::U16 => Value::U16(v.try_into().ok()?),
            ValueType::I16 => Value::I16(v.try_into().ok()?),
            ValueType::U32 => Value::U32(v.try_into().ok()?),
            ValueType::I32 => Value::I32(v.try_into().ok()?),
            ValueType::U64 => Value::U64(v),
            ValueType::I64 => Value::I64(v.try_into().ok()?),
            _ => return None,
        })
    }
}
