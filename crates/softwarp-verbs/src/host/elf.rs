//! The version nodes an ELF shared object defines (its `.gnu.version_d` section), read from
//! the file: how the layer knows which rdma-core release a host `libibverbs.so.1` is before
//! loading it (`IBVERBS_PRIVATE_34` is rdma-core v44's private interface).
//!
//! Only 64-bit little-endian objects are read (x86-64 and AArch64 Linux); anything else, or a
//! file without the section, is an error, and the layer does not use the library.

use std::path::Path;

/// `SHT_GNU_verdef`.
const SHT_GNU_VERDEF: u32 = 0x6fff_fffd;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn u64_at(b: &[u8], at: usize) -> Option<usize> {
    let v = u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?);
    usize::try_from(v).ok()
}

fn cstr_at(b: &[u8], at: usize) -> Option<String> {
    let tail = b.get(at..)?;
    let end = tail.iter().position(|&c| c == 0)?;
    Some(String::from_utf8_lossy(tail.get(..end)?).into_owned())
}

/// The names of the version nodes `path` defines, the base node (its soname) first.
pub fn version_definitions(path: &Path) -> Result<Vec<String>, String> {
    let b = std::fs::read(path).map_err(|e| format!("cannot read it: {e}"))?;
    parse(&b).ok_or_else(|| "not a 64-bit little-endian ELF object with version definitions".into())
}

fn parse(b: &[u8]) -> Option<Vec<String>> {
    // e_ident: magic, ELFCLASS64 (2), ELFDATA2LSB (1).
    if b.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let shoff = u64_at(b, 0x28)?;
    let shentsize = usize::from(u16_at(b, 0x3a)?);
    let shnum = usize::from(u16_at(b, 0x3c)?);
    let section = |i: usize| shoff.checked_add(i.checked_mul(shentsize)?);
    for i in 0..shnum {
        let sh = section(i)?;
        if u32_at(b, sh.checked_add(4)?)? != SHT_GNU_VERDEF {
            continue;
        }
        let offset = u64_at(b, sh.checked_add(0x18)?)?;
        let link = usize::try_from(u32_at(b, sh.checked_add(0x28)?)?).ok()?;
        let strtab = u64_at(b, section(link)?.checked_add(0x18)?)?;
        let mut names = Vec::new();
        let mut at = offset;
        // Each Elf64_Verdef: vd_cnt at 6, vd_aux at 12, vd_next at 16; its first
        // Elf64_Verdaux names the node (vda_name at 0). Bounded by the file's size.
        for _ in 0..b.len() / 20 {
            let aux = at.checked_add(usize::try_from(u32_at(b, at.checked_add(12)?)?).ok()?)?;
            let name = usize::try_from(u32_at(b, aux)?).ok()?;
            names.push(cstr_at(b, strtab.checked_add(name)?)?);
            let next = usize::try_from(u32_at(b, at.checked_add(16)?)?).ok()?;
            if next == 0 {
                return Some(names);
            }
            at = at.checked_add(next)?;
        }
        return None;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_tests_own_executable_is_read_or_refused_without_a_panic() {
        // A test executable defines no versions: an error, not a crash.
        let exe = std::env::current_exe().expect("test executable");
        assert!(version_definitions(&exe).is_err());
        assert!(parse(b"\x7fELF\x02\x01").is_none());
        assert!(parse(b"").is_none());
    }

    #[test]
    fn debian_libibverbs_defines_rdma_core_v44s_nodes() {
        let p = Path::new("/usr/lib/x86_64-linux-gnu/libibverbs.so.1");
        if !p.exists() {
            return; // the layer's tests with the stand-in library cover the rest
        }
        let v = version_definitions(p).expect("Debian libibverbs");
        assert_eq!(v.first().map(String::as_str), Some("libibverbs.so.1"));
        assert!(v.iter().any(|n| n == "IBVERBS_1.1"), "{v:?}");
        assert!(v.iter().any(|n| n.starts_with("IBVERBS_PRIVATE_")), "{v:?}");
    }
}
