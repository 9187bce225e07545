//! Page-aligned buffers for O_DIRECT I/O.
//!
//! A read owns its buffer while the kernel fills it and gets it back with the result, so no
//! one sees bytes the kernel is still writing; a write shares its buffer (`Arc`), as the kernel
//! only reads from it and the same block's bytes may be going to readers meanwhile.
//!
//! Block-sized buffers (1 MiB and up) are mapped from the kernel and, when dropped, kept in a
//! small pool for the next one of the same size: a fill or a block read reuses memory whose
//! pages are already backed instead of faulting in fresh ones (costly on a VM), and memory past
//! the pool goes back to the kernel at once instead of staying in the allocator's arenas.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;

/// Alignment of every buffer, offset and length handed to the kernel with O_DIRECT.
pub const ALIGN: usize = 4096;

/// Rounds `n` up to the next multiple of [`ALIGN`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN as u64) * ALIGN as u64
}

/// Buffers at least this large are mapped and pooled.
const MAPPED_MIN: usize = 1 << 20;

/// A transparent huge page on x86-64 and most arm64 kernels: where mapped buffers start.
const HUGE_PAGE: usize = 2 << 20;

/// Bytes of dropped mapped buffers kept for reuse.
const POOL_BYTES: usize = 64 << 20;

/// Dropped mapped buffers: (start, capacity).
struct Pool {
    buffers: Vec<(NonNull<u8>, usize)>,
    bytes: usize,
}

// SAFETY: the pool owns the mappings it holds; nothing else refers to them.
unsafe impl Send for Pool {}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    buffers: Vec::new(),
    bytes: 0,
});

/// A buffer whose start and capacity are multiples of [`ALIGN`]; every byte is initialised
/// (zeroes, or what an earlier buffer held).
///
/// `len` is how many bytes are valid (read from disk, or to be written); `capacity` is fixed.
/// The bytes after `len` up to the next [`ALIGN`] boundary are zeroes whenever `len` was set by
/// [`Self::extend_from_slice`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    capacity: usize,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory with no interior references.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of at least `capacity` bytes (rounded up to [`ALIGN`]), with `len` = 0.
    pub fn new(capacity: usize) -> Self {
        let capacity = (capacity.max(1)).div_ceil(ALIGN) * ALIGN;
        let ptr = if capacity >= MAPPED_MIN {
            Self::take_mapped(capacity)
        } else {
            let layout = Self::layout(capacity);
            // SAFETY: the layout has a non-zero size.
            let raw = unsafe { alloc::alloc_zeroed(layout) };
            NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout))
        };
        Self {
            ptr,
            capacity,
            len: 0,
        }
    }

    /// A pooled mapping of `capacity` bytes, or a new one (zeroed by the kernel).
    fn take_mapped(capacity: usize) -> NonNull<u8> {
        {
            let mut pool = POOL.lock();
            if let Some(i) = pool.buffers.iter().position(|&(_, c)| c == capacity) {
                pool.bytes -= capacity;
                return pool.buffers.swap_remove(i).0;
            }
        }
        // Mapped with room to start on a huge page boundary, the rest given back: a block
        // buffer then faults in a few 2 MiB pages, not a thousand 4 KiB ones (a tenth of a
        // cold read's CPU went to those faults).
        let mapped = capacity + HUGE_PAGE;
        // SAFETY: a new private anonymous mapping; no existing memory is affected.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED || raw.is_null() {
            alloc::handle_alloc_error(Self::layout(capacity));
        }
        let start = raw as usize;
        let aligned = start.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (aligned - start, start + mapped - (aligned + capacity));
        // SAFETY: the head and the tail are parts of the mapping just made that the buffer
        // does not cover; the hint only asks for huge pages (a kernel without them ignores it).
        unsafe {
            if head > 0 {
                libc::munmap(raw, head);
            }
            if tail > 0 {
                libc::munmap((aligned + capacity) as *mut libc::c_void, tail);
            }
            libc::madvise(aligned as *mut libc::c_void, capacity, libc::MADV_HUGEPAGE);
        }
        match NonNull::new(aligned as *mut u8) {
            Some(ptr) => ptr,
            None => alloc::handle_alloc_error(Self::layout(capacity)),
        }
    }

    /// A buffer holding a copy of `data`, zero-padded to the next [`ALIGN`] boundary.
    pub fn copy_from(data: &[u8]) -> Self {
        let mut buf = Self::new(data.len());
        buf.extend_from_slice(data);
        buf
    }

    fn layout(capacity: usize) -> Layout {
        match Layout::from_size_align(capacity, ALIGN) {
            Ok(layout) => layout,
            Err(_) => panic!("buffer of {capacity} bytes is larger than the address space"),
        }
    }

    /// The fixed capacity, a multiple of [`ALIGN`].
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of valid bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no byte is valid.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Marks the first `len` bytes valid.
    ///
    /// # Panics
    /// If `len` is larger than the capacity.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity,
            "len {len} exceeds capacity {}",
            self.capacity
        );
        self.len = len;
    }

    /// The whole capacity, valid or not, for the kernel or a copy to fill.
    pub fn spare_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` points to `capacity` initialised bytes we own (see the type's doc).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity) }
    }

    /// `len` rounded up to [`ALIGN`]: what an O_DIRECT write of this buffer writes (the
    /// padding is zeroes).
    pub fn padded_len(&self) -> usize {
        self.len.div_ceil(ALIGN) * ALIGN
    }

    /// The valid bytes and their zero padding up to [`Self::padded_len`].
    pub fn padded(&self) -> &[u8] {
        // SAFETY: `padded_len() <= capacity`, all initialised and owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.padded_len()) }
    }

    /// Raw pointer to the start, for read submissions.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Raw pointer to the start, for write submissions.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Appends `data` after the valid bytes, and zeroes the bytes after them up to the next
    /// [`ALIGN`] boundary (the padding an O_DIRECT write writes).
    ///
    /// # Panics
    /// If it does not fit in the capacity.
    pub fn extend_from_slice(&mut self, data: &[u8]) {
        let (start, end) = (self.len, self.len + data.len());
        let spare = self.spare_mut();
        spare[start..end].copy_from_slice(data);
        spare[end..end.div_ceil(ALIGN) * ALIGN].fill(0);
        self.len = end;
    }

    /// The valid bytes as `Bytes`, sharing the buffer without a copy.
    pub fn shared_bytes(buf: &Arc<Self>) -> bytes::Bytes {
        bytes::Bytes::from_owner(SharedBuf(buf.clone()))
    }
}

/// An [`AlignedBuf`] shared read-only, as the owner of a `Bytes`.
struct SharedBuf(Arc<AlignedBuf>);

impl AsRef<[u8]> for SharedBuf {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref().as_ref()
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the first `len` bytes are initialised and owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let capacity = self.capacity;
        if capacity < MAPPED_MIN {
            // SAFETY: allocated in `new` with exactly this layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(capacity)) }
            return;
        }
        {
            let mut pool = POOL.lock();
            if pool.bytes + capacity <= POOL_BYTES {
                pool.bytes += capacity;
                pool.buffers.push((self.ptr, capacity));
                return;
            }
        }
        // SAFETY: mapped in `take_mapped` with this length; nothing refers to it any more.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), capacity) };
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_buffer_is_padded_with_zeroes() {
        let capacity = 2 * MAPPED_MIN;
        drop(AlignedBuf::copy_from(&vec![0xAB; capacity]));
        // Most likely the same mapping, still holding 0xAB; the padding must be zeroes anyway.
        let mut buf = AlignedBuf::new(capacity);
        buf.extend_from_slice(&[1; 10]);
        buf.extend_from_slice(&[2; 5000]);
        assert_eq!(buf.padded_len(), 8192);
        let padded = buf.padded();
        assert!(padded[..10].iter().all(|&b| b == 1) && padded[10..5010].iter().all(|&b| b == 2));
        assert!(padded[5010..].iter().all(|&b| b == 0));
    }

    #[test]
    fn buffers_are_aligned_and_padded() {
        let buf = AlignedBuf::copy_from(&[7u8; 5000]);
        assert_eq!(buf.as_ref().as_ptr() as usize % ALIGN, 0);
        assert_eq!(buf.capacity(), 8192);
        assert_eq!(buf.len(), 5000);
        let mut buf = buf;
        assert!(buf.spare_mut()[5000..].iter().all(|&b| b == 0));
        assert_eq!(align_up(1), 4096);
        assert_eq!(align_up(4096), 4096);
        assert_eq!(align_up(0), 0);
    }
}
