//! Memory-mapped model files.

use memmap2::Mmap;

/// Lets the pages of `bytes` (a range of `mmap`) go from this process's memory once a tensor
/// has been copied out of them: a hint; reading them again faults them back in from the file.
/// NOTE: every loader copies (or converts) what it reads, so without this a model's file
/// stayed resident beside its weights until the mapping was dropped, and loading peaked near
/// twice the weights' size.
pub fn release(mmap: &Mmap, bytes: &[u8]) {
    #[cfg(unix)]
    if let Some(start) = (bytes.as_ptr() as usize).checked_sub(mmap.as_ptr() as usize) {
        // SAFETY: the mapping is read-only and shared, so dropping its pages (memmap2 widens
        // the range to whole pages) loses nothing: the next access reads the file again.
        let _ = unsafe {
            mmap.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, bytes.len())
        };
    }
    #[cfg(not(unix))]
    let _ = (mmap, bytes);
}
