//! Sizes in bytes as people write and read them: one parser for every size a user
//! types (`--max-memory 12GiB`) and one way to print a size, so `shoal status`, the
//! plan and the CLI's messages agree. Parsing and printing are the `bytesize` crate's;
//! the one rule of our own is that a bare letter (`12G`, `512m`) means the binary unit,
//! as in Docker's `-m`, systemd's `MemoryMax=` and this CLI before it took units.

use bytesize::ByteSize;

/// The spellings [`parse_size`] takes, for `--help` texts and error messages.
pub const SIZE_SPELLINGS: &str =
    "a number of bytes, or with a unit: K/M/G/T or KiB/MiB/GiB/TiB (powers of 1024), KB/MB/GB/TB (powers of 1000); \
     decimals (1.5G) and a space (12 GiB) are fine";

/// Why a size was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// Not a number with a known unit.
    #[error("{0:?} is not a size: use {SIZE_SPELLINGS}")]
    Malformed(String),
    /// More bytes than a 64-bit count holds.
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// Parse a size: `1000`, `512M`, `100MiB`, `12 GiB`, `12GB`, `1.5G`, `2t` (units are
/// case-insensitive; see [`SIZE_SPELLINGS`]).
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    let malformed = || SizeError::Malformed(text.to_string());
    // The number: digits with at most one point, and at least one digit.
    let number_len = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(number_len);
    if number.is_empty() || number.matches('.').count() > 1 || !number.contains(|c: char| c.is_ascii_digit()) {
        return Err(malformed());
    }
    let unit = unit.trim_start();
    // A bare letter is the binary unit (bytesize reads it as the decimal one).
    let unit = match unit.to_ascii_lowercase().as_str() {
        u @ ("k" | "m" | "g" | "t") => format!("{u}i"),
        u => u.to_string(),
    };
    // Whole numbers are exact; bytesize computes in f64, which saturates a too-large
    // count instead of refusing it, so the bound is checked here first.
    let factor = match unit.as_str() {
        "" | "b" => 1u64,
        _ => format!("1{unit}").parse::<ByteSize>().map_err(|_| malformed())?.as_u64(),
    };
    if let Ok(n) = number.parse::<u64>() {
        return n.checked_mul(factor).ok_or_else(|| SizeError::TooLarge(text.to_string()));
    }
    let value: f64 = number.parse().map_err(|_| malformed())?;
    let bytes = value * factor as f64;
    // u64::MAX as f64 rounds up to 2^64: anything at or above it does not fit.
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(SizeError::TooLarge(text.to_string()));
    }
    Ok(bytes.round() as u64)
}

/// A size as every Shoal output prints it: binary units with one decimal (`89.0 MiB`,
/// `1.5 GiB`), bytes below 1 KiB (`512 B`).
pub fn fmt_size(bytes: u64) -> String {
    ByteSize::b(bytes).display().iec().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usual_spellings_parse() {
        for (text, want) in [
            ("1000", 1000),
            ("0", 0),
            ("512M", 512 << 20),
            ("512m", 512 << 20),
            ("2g", 2 << 30),
            ("12G", 12 << 30),
            ("100MiB", 100 << 20),
            ("100 MiB", 100 << 20),
            ("12GiB", 12 << 30),
            ("12gib", 12 << 30),
            ("12GB", 12_000_000_000),
            ("12 gb", 12_000_000_000),
            ("1.5G", 3 << 29),
            ("1.5 GiB", 3 << 29),
            ("0.5KB", 500),
            ("2T", 2 << 40),
            ("2TiB", 2 << 40),
            ("3TB", 3_000_000_000_000),
            ("64K", 64 << 10),
            ("64KiB", 64 << 10),
            ("64KB", 64_000),
            ("10B", 10),
            (" 7 MiB ", 7 << 20),
        ] {
            assert_eq!(parse_size(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn other_text_is_refused_with_the_spellings() {
        for text in ["", "G", "GiB", "12X", "12 parsecs", "1.2.3G", ".G", "-1G", "12GiBs", "1e9", "twelve"] {
            let e = parse_size(text).unwrap_err();
            assert!(matches!(e, SizeError::Malformed(_)), "{text}: {e}");
            assert!(e.to_string().contains("KiB/MiB/GiB/TiB"), "{e}");
        }
        for text in ["99999999999T", "18446744073709551616", "20000000000GiB", "99999999999.5T"] {
            assert!(matches!(parse_size(text), Err(SizeError::TooLarge(_))), "{text}");
        }
    }

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(fmt_size(512), "512 B");
        assert_eq!(fmt_size(89 << 20), "89.0 MiB");
        assert_eq!(fmt_size(3 << 29), "1.5 GiB");
        // What is printed parses back to about the same size.
        let printed = fmt_size(123_456_789);
        let back = parse_size(&printed).unwrap();
        assert!(back.abs_diff(123_456_789) < 1 << 20, "{printed} -> {back}");
    }
}
