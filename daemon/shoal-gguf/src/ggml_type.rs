//! The ggml tensor types a GGUF file may use, with the block geometry needed to
//! compute a tensor's size without asking llama.cpp.

use std::fmt;

/// A ggml tensor type that Shoal knows the size of. Ids follow `ggml.h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType {
    /// The id stored in the file.
    pub id: u32,
    /// ggml's name for it.
    pub name: &'static str,
    /// Elements per block.
    pub block_size: u64,
    /// Bytes per block.
    pub type_size: u64,
}

/// (id, name, elements per block, bytes per block), from ggml's `type_traits`.
/// Ids 4, 5, 31–33 and 36–38 were removed from ggml; 40+ are too new for us to trust.
const TYPES: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// The type with this id, if Shoal supports it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().find(|t| t.0 == id).map(|&(id, name, block_size, type_size)| GgmlType {
            id,
            name,
            block_size,
            type_size,
        })
    }

    /// Every supported type (for cross-checks against ggml).
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TYPES.iter().filter_map(|t| GgmlType::from_id(t.0))
    }

    /// Bytes taken by `n_elements` values, or `None` if `n_elements` is not a whole
    /// number of blocks or the size overflows.
    pub fn bytes_for(&self, n_elements: u64) -> Option<u64> {
        if !n_elements.is_multiple_of(self.block_size) {
            return None;
        }
        (n_elements / self.block_size).checked_mul(self.type_size)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}
