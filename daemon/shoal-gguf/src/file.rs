//! Reading and validating a GGUF file's header (metadata and tensor table), and
//! writing one. Every check llama.cpp's own reader makes that could abort the
//! process is made here first, in Rust, with an error that names the file and the
//! problem: a GGUF from disk or the network is untrusted input.

use crate::ggml_type::GgmlType;
use crate::value::{Value, ValueType};
use crate::GgufError;
use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};

/// "GGUF", little-endian.
const MAGIC: &[u8; 4] = b"GGUF";
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// ggml's `GGML_MAX_NAME`: tensor names are at most 63 bytes.
const MAX_NAME: usize = 63;
/// Refuse headers larger than this: real ones (vocabulary included) are a few tens
/// of MB, and a hostile one must not make us allocate gigabytes.
pub const MAX_HEADER_BYTES: u64 = 256 << 20;
/// Most memory the parsed header (metadata values, keys, tensor table) may take,
/// counted as the reader allocates it: an array of a million 1-byte values takes
/// 1 MB of file but tens of MB as [`Value`]s. Real headers (a 256k-token vocabulary
/// included) take about 50 MB.
pub const MAX_HEADER_MEMORY: u64 = 256 << 20;
/// A header may take this many bytes of memory per byte of file (within
/// [`MAX_HEADER_MEMORY`], and at least [`MIN_HEADER_MEMORY`]), so a small file cannot
/// make the reader allocate much more than itself. An array of 4-byte values takes
/// 8 bytes of memory per byte of file, strings less; only arrays of 1- and 2-byte
/// values take more, and those are rare and short in real models.
pub const HEADER_MEMORY_PER_FILE_BYTE: u64 = 16;
/// The memory budget of a header however small its file (see
/// [`HEADER_MEMORY_PER_FILE_BYTE`]).
pub const MIN_HEADER_MEMORY: u64 = 16 << 20;
/// Alignment of the data section when the file does not say (`general.alignment`).
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// One tensor's entry in the tensor table.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Name, e.g. `blk.3.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost first (ggml's `ne`).
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of its bytes from the start of the data section.
    pub offset: u64,
    /// Size of its bytes.
    pub bytes: u64,
}

impl TensorInfo {
    /// The block index if this is a per-layer tensor (`blk.N.…`), with the rest of the name.
    pub fn layer(&self) -> Option<(u32, &str)> {
        let rest = self.name.strip_prefix("blk.")?;
        let (n, tail) = rest.split_once('.')?;
        Some((n.parse().ok()?, tail))
    }
}

/// A parsed and validated GGUF header.
#[derive(Clone, Debug)]
pub struct Gguf {
    /// Where it was read from (or a label for in-memory input), for error messages.
    pub path: PathBuf,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor table in file order (the data section follows the same order).
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and of each tensor in it.
    pub alignment: u64,
    /// Where the data section starts in the file.
    pub data_offset: u64,
    /// Size of the whole file.
    pub file_size: u64,
}

impl Gguf {
    /// Read and validate the header of the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let file = File::open(path).map_err(|e| GgufError::io(path, e))?;
        let len = file.metadata().map_err(|e| GgufError::io(path, e))?.len();
        Gguf::parse(BufReader::with_capacity(1 << 20, file), len, path)
    }

    /// Parse a header from `reader`, which yields a file of `len` bytes.
    pub fn parse(reader: impl Read, len: u64, path: &Path) -> Result<Gguf, GgufError> {
        let mut r = Reader { inner: reader, pos: 0, len, path, memory: 0, memory_budget: header_memory_budget(len) };
        let magic = r.bytes_fixed::<4>("magic")?;
        if &magic != MAGIC {
            return Err(r.invalid(format!("not a GGUF file (magic {:02x?}, expected \"GGUF\")", magic)));
        }
        let version = r.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::Unsupported {
                path: path.to_owned(),
                what: format!("GGUF version {version} (supported: 2 and 3; a big-endian file reads as a huge version)"),
            });
        }
        let n_tensors = r.u64("tensor count")?;
        let n_kv = r.u64("metadata count")?;
        // Each entry takes some bytes at least: refuse counts the file cannot hold
        // before allocating anything for them.
        r.ensure_room(n_kv, 13, "metadata count")?;
        r.charge(n_kv.saturating_mul(size_of::<(String, Value)>() as u64), "metadata count")?;
        // Charged in full (and so bounded): allocate it at once.
        let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv as usize);
        // Keys seen so far: a set, not a scan of `metadata` per key, which would be
        // quadratic in a count the file chooses.
        let mut keys = std::collections::HashSet::new();
        for i in 0..n_kv {
            let key = r.string_utf8(&format!("key of metadata entry {i}"))?;
            if key.is_empty() {
                return Err(r.invalid(format!("metadata entry {i} has an empty key")));
            }
            // The key's copy in `keys` (its bytes in `metadata` were counted as read).
            r.charge((size_of::<String>() + key.len()) as u64, &key)?;
            if !keys.insert(key.clone()) {
                return Err(r.invalid(format!("duplicate metadata key {key:?}")));
            }
            let ty = r.value_type(&key)?;
            let value = r.value(ty, &key, true)?;
            metadata.push((key, value));
        }
        r.ensure_room(n_tensors, 32, "tensor count")?;
        r.charge(n_tensors.saturating_mul(size_of::<TensorInfo>() as u64), "tensor count")?;
        let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors as usize);
        let mut names = std::collections::HashSet::new();
        for i in 0..n_tensors {
            let name = r.string_utf8(&format!("name of tensor {i}"))?;
            if name.is_empty() || name.len() > MAX_NAME {
                return Err(
                    r.invalid(format!("tensor {i} has a name of {} bytes (1..={MAX_NAME} allowed)", name.len()))
                );
            }
            if !names.insert(name.clone()) {
                return Err(r.invalid(format!("duplicate tensor name {name:?}")));
            }
            let n_dims = r.u32(&name)?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.invalid(format!("tensor {name:?} has {n_dims} dimensions (1..={MAX_DIMS} allowed)")));
            }
            // Its dimensions, and the name's copy in `names`.
            let entry = 8 * n_dims as usize + size_of::<String>() + name.len();
            r.charge(entry as u64, &name)?;
            let mut dims = Vec::with_capacity(n_dims as usize);
            let mut n_elements: u64 = 1;
            for _ in 0..n_dims {
                let d = r.u64(&name)?;
                n_elements = match n_elements.checked_mul(d) {
                    Some(n) if d > 0 && n <= i64::MAX as u64 => n,
                    _ => return Err(r.invalid(format!("tensor {name:?} has absurd dimensions (dimension {d})"))),
                };
                dims.push(d);
            }
            let type_id = r.u32(&name)?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| GgufError::Unsupported {
                path: path.to_owned(),
                what: format!("tensor {name:?} has ggml type id {type_id}, which Shoal does not support"),
            })?;
            if dims[0] % ggml_type.block_size != 0 {
                return Err(r.invalid(format!(
                    "tensor {name:?}: first dimension {} is not a multiple of the {} block size {}",
                    dims[0], ggml_type.name, ggml_type.block_size
                )));
            }
            let bytes =
                ggml_type.bytes_for(n_elements).ok_or_else(|| r.invalid(format!("tensor {name:?} has absurd size")))?;
            let offset = r.u64(&name)?;
            tensors.push(TensorInfo { name, dims, ggml_type, offset, bytes });
        }

        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, Value::U32(a))) if a.is_power_of_two() => u64::from(*a),
            Some((_, v)) => return Err(r.invalid(format!("general.alignment {v:?} is not a power-of-two u32"))),
        };
        // Invariant: `r.pos` is within MAX_HEADER_BYTES, far from overflowing.
        let data_offset = checked_align(r.pos, alignment).expect("header offset aligns");
        // Like llama.cpp, require tensors packed in table order, each aligned.
        let mut expected = 0u64;
        for t in &tensors {
            if t.offset != expected {
                return Err(r.invalid(format!("tensor {:?} has data offset {}, expected {expected}", t.name, t.offset)));
            }
            expected = t
                .offset
                .checked_add(t.bytes)
                .and_then(|end| checked_align(end, alignment))
                .filter(|&end| end <= len)
                .ok_or_else(|| r.invalid(format!("tensor {:?} has absurd data offset {}", t.name, t.offset)))?;
        }
        // Each tensor's end was checked against the file length above. A file of no
        // tensors (llama.cpp's vocabulary-only GGUFs) has no data section to pad to.
        let data_end = tensors.last().map_or(0, |t| t.offset.saturating_add(t.bytes));
        if !tensors.is_empty() && data_offset.checked_add(data_end).is_none_or(|end| end > len) {
            return Err(GgufError::Truncated {
                path: path.to_owned(),
                what: format!(
                    "tensor data needs {} bytes after offset {data_offset}, the file has {len} bytes in all",
                    data_end
                ),
            });
        }
        Ok(Gguf { path: path.to_owned(), version, metadata, tensors, alignment, data_offset, file_size: len })
    }

    /// The metadata value under `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Where tensor `t`'s bytes start in the file.
    pub fn file_offset(&self, t: &TensorInfo) -> u64 {
        // Parsing checked that this is within the file; saturate for hand-built headers.
        self.data_offset.saturating_add(t.offset)
    }
}

/// Round `x` up to a multiple of `a` (a power of two). For offsets within a parsed
/// file (which cannot overflow); values read from a file go through [`checked_align`].
pub(crate) fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Round `x` up to a multiple of `a` (a power of two), or `None` past `u64::MAX`.
pub(crate) fn checked_align(x: u64, a: u64) -> Option<u64> {
    x.div_ceil(a).checked_mul(a)
}

/// The memory budget of the header of a file of `len` bytes: [`HEADER_MEMORY_PER_FILE_BYTE`]
/// per byte, at least [`MIN_HEADER_MEMORY`], at most [`MAX_HEADER_MEMORY`].
pub fn header_memory_budget(len: u64) -> u64 {
    len.saturating_mul(HEADER_MEMORY_PER_FILE_BYTE).clamp(MIN_HEADER_MEMORY, MAX_HEADER_MEMORY)
}

/// Serialise a header (magic … tensor table) followed by padding up to the data
/// section. Tensor offsets are taken as given. Returns the bytes written.
pub fn write_header(
    w: &mut impl Write,
    metadata: &[(String, Value)],
    tensors: &[TensorInfo],
    alignment: u64,
) -> io::Result<u64> {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        put_string(&mut out, k.as_bytes());
        out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
        put_value(&mut out, v);
    }
    for t in tensors {
        put_string(&mut out, t.name.as_bytes());
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ggml_type.id.to_le_bytes());
        out.extend_from_slice(&t.offset.to_le_bytes());
    }
    let padded = align(out.len() as u64, alignment);
    out.resize(padded as usize, 0);
    w.write_all(&out)?;
    Ok(padded)
}

fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_string(out, s),
        Value::Array(ty, items) => {
            out.extend_from_slice(&(*ty as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// A bounds-checked little-endian reader that knows the file length, so that no
/// count read from the file can make us read past its end or allocate for it; and
/// that counts the memory of what it parses against a budget.
struct Reader<'p, R> {
    inner: R,
    pos: u64,
    len: u64,
    path: &'p Path,
    /// Bytes of memory the parsed header takes so far (charged before allocating).
    memory: u64,
    /// The most it may take ([`header_memory_budget`] of the file's length).
    memory_budget: u64,
}

impl<R: Read> Reader<'_, R> {
    fn invalid(&self, what: String) -> GgufError {
        GgufError::Invalid { path: self.path.to_owned(), offset: self.pos, what }
    }

    /// Fail unless `count` items of at least `min_size` bytes fit in the rest of the
    /// file and of the header budget.
    fn ensure_room(&self, count: u64, min_size: u64, what: &str) -> Result<(), GgufError> {
        let room = self.len.saturating_sub(self.pos).min(MAX_HEADER_BYTES);
        if count.checked_mul(min_size).is_none_or(|need| need > room) {
            return Err(self.invalid(format!("{what} {count} is absurd: the file cannot hold that many")));
        }
        Ok(())
    }

    /// Count `bytes` of memory the header is about to take for `what`; fail when that
    /// goes over the budget (before anything is allocated for it).
    fn charge(&mut self, bytes: u64, what: &str) -> Result<(), GgufError> {
        match self.memory.checked_add(bytes).filter(|&m| m <= self.memory_budget) {
            Some(m) => {
                self.memory = m;
                Ok(())
            }
            None => Err(self.invalid(format!(
                "the header would take more than {} MiB of memory (reading {what:?}; at most {} MiB for \
                 a file of {} bytes)",
                self.memory >> 20,
                self.memory_budget >> 20,
                self.len
            ))),
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<(), GgufError> {
        if self.pos.saturating_add(n) > self.len {
            return Err(GgufError::Truncated {
                path: self.path.to_owned(),
                what: format!("file ends at byte {} while reading {what} ({n} bytes at offset {})", self.len, self.pos),
            });
        }
        if self.pos + n > MAX_HEADER_BYTES {
            return Err(self.invalid(format!("header exceeds {} MiB while reading {what}", MAX_HEADER_BYTES >> 20)));
        }
        self.pos += n;
        Ok(())
    }

    fn fill(&mut self, buf: &mut [u8], what: &str) -> Result<(), GgufError> {
        self.take(buf.len() as u64, what)?;
        self.inner.read_exact(buf).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => GgufError::Truncated {
                path: self.path.to_owned(),
                what: format!("file ended early while reading {what}"),
            },
            _ => GgufError::io(self.path, e),
        })
    }

    fn bytes_fixed<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut b = [0u8; N];
        self.fill(&mut b, what)?;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes_fixed(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes_fixed(what)?))
    }

    fn string(&mut self, what: &str) -> Result<Vec<u8>, GgufError> {
        let n = self.u64(what)?;
        self.ensure_room(n, 1, &format!("length of {what}"))?;
        self.charge(n, what)?;
        let mut s = vec![0u8; n as usize];
        self.fill(&mut s, what)?;
        Ok(s)
    }

    fn string_utf8(&mut self, what: &str) -> Result<String, GgufError> {
        let b = self.string(what)?;
        String::from_utf8(b).map_err(|_| self.invalid(format!("{what} is not UTF-8")))
    }

    fn value_type(&mut self, key: &str) -> Result<ValueType, GgufError> {
        let id = self.u32(key)?;
        ValueType::from_id(id).ok_or_else(|| self.invalid(format!("metadata {key:?} has unknown value type {id}")))
    }

    fn value(&mut self, ty: ValueType, key: &str, top: bool) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.bytes_fixed::<1>(key)?[0]),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.bytes_fixed(key)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.bytes_fixed(key)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.bytes_fixed(key)?)),
            ValueType::U32 => Value::U32(self.u32(key)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.bytes_fixed(key)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.bytes_fixed(key)?)),
            ValueType::Bool => match self.bytes_fixed::<1>(key)?[0] {
                b @ (0 | 1) => Value::Bool(b == 1),
                b => return Err(self.invalid(format!("metadata {key:?} has bool value {b}"))),
            },
            ValueType::String => Value::String(self.string(key)?),
            ValueType::U64 => Value::U64(self.u64(key)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.bytes_fixed(key)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.bytes_fixed(key)?)),
            ValueType::Array => {
                if !top {
                    return Err(
                        self.invalid(format!("metadata {key:?} nests arrays, which GGUF readers do not support"))
                    );
                }
                let elem = self.value_type(key)?;
                let n = self.u64(key)?;
                self.ensure_room(n, elem.min_size(), &format!("array length of {key:?}"))?;
                // Every element is a whole `Value` in memory (32 bytes, whatever the
                // element type), however few bytes it takes in the file; strings
                // charge their bytes as they are read, nested arrays their elements.
                let elements = n.saturating_mul(size_of::<Value>() as u64);
                self.charge(elements, key)?;
                // Charged in full, so allocating it all at once is within the budget.
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, key, false)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader over `bytes` with a memory budget of `budget` bytes.
    fn reader(bytes: &[u8], budget: u64) -> Reader<'static, &[u8]> {
        Reader {
            inner: bytes,
            pos: 0,
            len: bytes.len() as u64,
            path: Path::new("mem"),
            memory: 0,
            memory_budget: budget,
        }
    }

    fn encoded(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        put_value(&mut out, v);
        out
    }

    #[test]
    fn string_bytes_count_against_the_memory_budget() {
        let s = Value::String(vec![b'a'; 2000]);
        let bytes = encoded(&s);
        assert_eq!(reader(&bytes, 2000).value(ValueType::String, "k", true).unwrap(), s);
        let e = reader(&bytes, 1999).value(ValueType::String, "k", true).unwrap_err();
        assert!(e.to_string().contains("of memory"), "{e}");
    }

    #[test]
    fn array_elements_count_their_in_memory_size_and_their_strings() {
        let items = vec![Value::String(vec![b'b'; 100]); 10];
        let bytes = encoded(&Value::Array(ValueType::String, items.clone()));
        // 10 `Value`s plus 10 × 100 string bytes.
        let need = 10 * size_of::<Value>() as u64 + 1000;
        let mut r = reader(&bytes, need);
        assert_eq!(r.value(ValueType::Array, "k", true).unwrap(), Value::Array(ValueType::String, items));
        assert_eq!(r.memory, need);
        let e = reader(&bytes, need - 1).value(ValueType::Array, "k", true).unwrap_err();
        assert!(e.to_string().contains("of memory"), "{e}");
        // One-byte elements are charged as whole `Value`s: 32 times their file bytes.
        let bytes = encoded(&Value::Array(ValueType::U8, vec![Value::U8(1); 1000]));
        let mut r = reader(&bytes, 1 << 20);
        r.value(ValueType::Array, "k", true).unwrap();
        assert_eq!(r.memory, 1000 * size_of::<Value>() as u64);
        assert!(reader(&bytes, 999 * size_of::<Value>() as u64).value(ValueType::Array, "k", true).is_err());
    }

    #[test]
    fn nested_arrays_are_refused() {
        let inner = Value::Array(ValueType::U32, vec![Value::U32(1)]);
        let bytes = encoded(&Value::Array(ValueType::Array, vec![inner]));
        let e = reader(&bytes, 1 << 20).value(ValueType::Array, "k", true).unwrap_err();
        assert!(e.to_string().contains("nests arrays"), "{e}");
    }

    #[test]
    fn checked_align_refuses_to_overflow() {
        assert_eq!(checked_align(33, 32), Some(64));
        assert_eq!(checked_align(u64::MAX - 7, 32), None);
        assert_eq!(checked_align(u64::MAX - 31, 32), Some(u64::MAX - 31));
    }
}
