//! Model-aware reading of safetensors files.
//!
//! A safetensors file is an 8-byte little-endian header length, a JSON header naming each
//! tensor's dtype, shape and byte extent in the data region after it, and the data region.
//! Loaders do not read it front to back: vLLM's iterator takes tensors in key order, through
//! mmap faults of a few pages; tensor-parallel ranks each take a slice of every tensor; so
//! the sequential detector sees short runs with jumps between them. Yet every loader reads
//! (nearly) every byte of the data region. So while a `.safetensors` file is open, a
//! [`ModelLoad`] shared by every handle of the object fetches its data region in file order,
//! at most a readahead window ahead of what the readers have read so far (counted in distinct
//! blocks, whatever their order): ranks reading disjoint slices share each block's one fetch,
//! and a loader that skips tensors costs at most one window of blocks it never reads.
//!
//! The header is input from the bucket, not trusted: a length past the object or over
//! [`MAX_HEADER`], a header that is not JSON of tensors, or extents out of range, overlapping
//! or not the size their dtype and shape make, and the file is read as a plain file (with the
//! sequential detector only) and one warning names it. Nothing is allocated or fetched from
//! what a header claims before it is checked against the object's size.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use larder_object::ObjectId;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::Notify;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::fill::FillFor;
use super::{Block, Cache, OpenObject, ReadError};

/// The largest header read: the safetensors library itself refuses headers over 100 MB, and
/// a model of 10,000 tensors has a header of about 1 MiB.
pub const MAX_HEADER: u64 = 16 << 20;

/// Objects whose header was refused that are remembered (so as to warn once and not read the
/// header again at each open); past this many the memory starts over.
const REFUSED_KEPT: usize = 4096;

/// Blocks present on disk a model load reads at once, ahead of its readers.
const DISK_READS_AHEAD: usize = 8;

/// Whether a file of this name is read as a safetensors model.
pub fn is_model_file(name: &str) -> bool {
    name.ends_with(".safetensors")
}

/// What a checked header says of its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Where the data region starts: 8 bytes and the header.
    pub data_start: u64,
    /// The tensors' extents in the file, in file order.
    pub tensors: Vec<Range<u64>>,
}

/// Why a file named `.safetensors` is read as a plain file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotAModel {
    /// Too short to hold the header's length.
    #[error("it is {0} bytes, too short for a safetensors header")]
    Short(u64),
    /// The header's length is more than is read.
    #[error("its header length is {0} bytes, over the {MAX_HEADER} bytes read")]
    HeaderTooLarge(u64),
    /// The header's length goes past the end of the file.
    #[error("its header length is {len} bytes, past the end of the {size}-byte file")]
    HeaderPastEnd {
        /// The header's length.
        len: u64,
        /// The file's size.
        size: u64,
    },
    /// The header is not a JSON object of tensors.
    #[error("its header is not a JSON object of tensors: {0}")]
    NotJson(String),
    /// A tensor's extent is wrong.
    #[error("tensor {name:?}: {what}")]
    BadTensor {
        /// The tensor.
        name: String,
        /// What is wrong with it.
        what: String,
    },
}

/// One tensor's entry in the header.
#[derive(Debug, Deserialize)]
struct TensorEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// The header's length from the file's first 8 bytes, checked against the file's `size`.
pub fn header_len(first: [u8; 8], size: u64) -> Result<u64, NotAModel> {
    let len = u64::from_le_bytes(first);
    if len > MAX_HEADER {
        return Err(NotAModel::HeaderTooLarge(len));
    }
    if 8 + len > size {
        return Err(NotAModel::HeaderPastEnd { len, size });
    }
    Ok(len)
}

/// Checks `header` (the JSON after the length) of a file of `size` bytes and gives the
/// tensors' extents.
pub fn parse_header(header: &[u8], size: u64) -> Result<Layout, NotAModel> {
    let data_start = 8 + header.len() as u64;
    let entries: HashMap<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| NotAModel::NotJson(e.to_string()))?;
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, value) in entries {
        if name == "__metadata__" {
            continue;
        }
        let bad = |what: String| NotAModel::BadTensor {
            name: name.clone(),
            what,
        };
        let entry = TensorEntry::deserialize(&value).map_err(|e| bad(e.to_string()))?;
        let (begin, end) = entry.data_offsets;
        if begin > end || end > size - data_start {
            return Err(bad(format!(
                "its data offsets {begin}..{end} are outside the {}-byte data region",
                size - data_start
            )));
        }
        if let Some(width) = dtype_width(&entry.dtype) {
            let expected = entry
                .shape
                .iter()
                .try_fold(width, |bytes, &dim| bytes.checked_mul(dim));
            let Some(expected) = expected else {
                return Err(bad(format!(
                    "its shape {:?} is larger than any file",
                    entry.shape
                )));
            };
            if expected != end - begin {
                return Err(bad(format!(
                    "its data offsets hold {} bytes, its dtype {} and shape {:?} make {expected}",
                    end - begin,
                    entry.dtype,
                    entry.shape
                )));
            }
        }
        tensors.push((name, data_start + begin..data_start + end));
    }
    tensors.sort_by_key(|(_, extent)| (extent.start, extent.end));
    for pair in tensors.windows(2) {
        let ((first, a), (second, b)) = (&pair[0], &pair[1]);
        if a.end > b.start {
            return Err(NotAModel::BadTensor {
                name: second.clone(),
                what: format!("its bytes overlap those of tensor {first:?}"),
            });
        }
    }
    Ok(Layout {
        data_start,
        tensors: tensors.into_iter().map(|(_, extent)| extent).collect(),
    })
}

/// The bytes of one element of `dtype`, where it is a dtype the format names.
fn dtype_width(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// Reads and checks the header of `object` through `cache`.
async fn read_layout(
    cache: &Cache,
    object: &Arc<OpenObject>,
) -> Result<Result<Layout, NotAModel>, ReadError> {
    let size = object.version.size;
    if size < 8 {
        return Ok(Err(NotAModel::Short(size)));
    }
    let first = read_bytes(cache, object, 0..8).await?;
    let first: [u8; 8] = first[..].try_into().map_err(|_| ReadError::Abandoned)?;
    let len = match header_len(first, size) {
        Ok(len) => len,
        Err(not) => return Ok(Err(not)),
    };
    let header = read_bytes(cache, object, 8..8 + len).await?;
    Ok(parse_header(&header, size))
}

/// Bytes `range` of `object` (within it), block by block: the daemon's own read, not a
/// reader's, so not counted as bytes served.
async fn read_bytes(
    cache: &Cache,
    object: &Arc<OpenObject>,
    range: Range<u64>,
) -> Result<Vec<u8>, ReadError> {
    let block_size = cache.store().block_size();
    let mut out = Vec::with_capacity((range.end - range.start) as usize);
    let mut offset = range.start;
    while offset < range.end {
        let index = (offset / block_size) as u32;
        let start = cache.block_start(index);
        let part = (offset - start) as usize..((range.end - start).min(block_size)) as usize;
        let block = cache.block(object, index, Some(part), FillFor::Node).await?;
        // A fill gives the whole block, a lookup the part: `start` says which.
        let from = (offset - block.start) as usize;
        let to = ((range.end - block.start) as usize).min(block.bytes.len());
        if from >= to {
            return Err(ReadError::Abandoned);
        }
        out.extend_from_slice(&block.bytes[from..to]);
        offset += (to - from) as u64;
    }
    Ok(out)
}

/// The model loads of a cache: one per open safetensors object, and the objects whose header
/// was refused.
#[derive(Debug, Default)]
pub(crate) struct Models {
    loads: Mutex<HashMap<ObjectId, Weak<ModelLoad>>>,
    refused: Mutex<HashSet<ObjectId>>,
}

impl Models {
    /// Remembers that `id`'s header was refused; whether it was not already.
    fn refuse(&self, id: ObjectId) -> bool {
        let mut refused = self.refused.lock();
        if refused.len() >= REFUSED_KEPT {
            refused.clear();
        }
        refused.insert(id)
    }
}

/// The load of one safetensors object while any handle of it is open: what its readers have
/// read, and the task fetching its data region ahead of them (stopped when the last handle
/// goes).
#[derive(Debug)]
pub struct ModelLoad {
    progress: Arc<Progress>,
    cache: Cache,
    id: ObjectId,
    block_size: u64,
    /// The object's size.
    size: u64,
    _stop: DropGuard,
}

/// What the readers of a load have read: the blocks they touched (the load's pace), and the
/// bytes read of the blocks touched and not yet read whole (a block read whole is let go
/// from memory).
#[derive(Debug)]
struct Progress {
    read: Mutex<Read>,
    count: AtomicU32,
    moved: Notify,
    /// False once the header was refused: the file is a plain file for its readers.
    active: AtomicBool,
}

#[derive(Debug, Default)]
struct Read {
    /// A bit per block touched.
    touched: Vec<u64>,
    /// The ranges read of each block touched and not read whole: sorted, disjoint, merged.
    partly: HashMap<u32, Vec<Range<u64>>>,
}

/// Adds `range` to `ranges` (sorted, disjoint, merged where they touch).
fn merge(ranges: &mut Vec<Range<u64>>, range: Range<u64>) {
    let (mut start, mut end) = (range.start, range.end);
    ranges.retain(|r| {
        let apart = r.end < start || r.start > end;
        if !apart {
            start = start.min(r.start);
            end = end.max(r.end);
        }
        apart
    });
    let at = ranges.partition_point(|r| r.start < start);
    ranges.insert(at, start..end);
}

impl ModelLoad {
    /// Whether its readers read as a model load's (until the header is refused).
    pub(crate) fn active(&self) -> bool {
        self.progress.active.load(Ordering::Relaxed)
    }

    /// Notes that a reader was served bytes `range` of the object (within it).
    pub(crate) fn note_read(&self, range: Range<u64>) {
        if range.is_empty() {
            return;
        }
        let (progress, block_size) = (&self.progress, self.block_size);
        let (first, last) = (
            (range.start / block_size) as u32,
            ((range.end - 1) / block_size) as u32,
        );
        let mut touched = 0;
        let mut whole = Vec::new();
        {
            let mut read = progress.read.lock();
            for block in first..=last {
                let (word, bit) = ((block / 64) as usize, 1u64 << (block % 64));
                if let Some(word) = read.touched.get_mut(word)
                    && *word & bit == 0
                {
                    *word |= bit;
                    touched += 1;
                }
                let extent =
                    u64::from(block) * block_size..(u64::from(block + 1) * block_size).min(self.size);
                let part = range.start.max(extent.start)..range.end.min(extent.end);
                let ranges = read.partly.entry(block).or_default();
                merge(ranges, part);
                if ranges.first() == Some(&extent) {
                    read.partly.remove(&block);
                    whole.push(block);
                }
            }
        }
        for block in whole {
            self.cache.sharing().release_kept((self.id, block));
        }
        if touched > 0 {
            progress.count.fetch_add(touched, Ordering::Relaxed);
            progress.moved.notify_waiters();
        }
    }
}

impl Drop for ModelLoad {
    fn drop(&mut self) {
        self.cache.sharing().set_loading(self.id, false);
    }
}

impl Cache {
    /// Bytes `part` of block `index` of a loaded object, for its reader: from the block kept
    /// for the load's readers, else from the whole block (from disk, checked whole, or
    /// fetched), which is then kept for the reads of its other parts (beyond the room kept
    /// blocks have: a reader's own block must not be read whole again for each part).
    pub(crate) async fn loaded_block(
        &self,
        object: &Arc<OpenObject>,
        index: u32,
        part: Range<usize>,
    ) -> Result<Block, ReadError> {
        let key = (object.id, index);
        if let Some(block) = self.take_kept(key, Some(&part)) {
            return Ok(block);
        }
        let block = self.spawn_block(object, index).await?;
        self.sharing().keep(key, &block, u64::MAX);
        Ok(block.part(&part))
    }

    /// The load of `object` (a file named `name`) if it is read as a safetensors model: shared
    /// by every handle open on it, its header read and its data region fetched ahead of the
    /// readers from the first call on. `None` for another file, or one whose header was
    /// refused.
    pub fn model_load(&self, object: &Arc<OpenObject>, name: &str) -> Option<Arc<ModelLoad>> {
        let models = &self.inner.models;
        if !is_model_file(name) || models.refused.lock().contains(&object.id) {
            return None;
        }
        let mut loads = models.loads.lock();
        if let Some(load) = loads.get(&object.id).and_then(Weak::upgrade) {
            return Some(load);
        }
        loads.retain(|_, load| load.strong_count() > 0);
        let blocks = u64::from(self.block_count(object));
        let progress = Arc::new(Progress {
            read: Mutex::new(Read {
                touched: vec![0; blocks.div_ceil(64) as usize],
                partly: HashMap::new(),
            }),
            count: AtomicU32::new(0),
            moved: Notify::new(),
            active: AtomicBool::new(true),
        });
        let stop = CancellationToken::new();
        self.sharing().set_loading(object.id, true);
        let load = Arc::new(ModelLoad {
            progress: progress.clone(),
            cache: self.clone(),
            id: object.id,
            block_size: self.inner.store.block_size(),
            size: object.version.size,
            _stop: stop.clone().drop_guard(),
        });
        loads.insert(object.id, Arc::downgrade(&load));
        let (cache, object, name) = (self.clone(), object.clone(), name.to_owned());
        self.spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = cache.load_ahead(&object, &name, &progress) => {}
            }
        });
        Some(load)
    }

    /// The body of a model load's task: reads the header, then keeps the data region coming
    /// in file order, a readahead window ahead of the blocks the readers have read: fills for
    /// the blocks missing from the cache, and disk reads (checked) for those present, each
    /// kept in memory for its reader.
    async fn load_ahead(&self, object: &Arc<OpenObject>, name: &str, progress: &Progress) {
        let layout = match read_layout(self, object).await {
            Ok(Ok(layout)) => layout,
            Ok(Err(not)) => {
                progress.active.store(false, Ordering::Relaxed);
                self.sharing().set_loading(object.id, false);
                if self.inner.models.refuse(object.id) {
                    tracing::warn!(
                        file = name,
                        reason = %not,
                        "a .safetensors file is not read as a model: it is read as a plain file"
                    );
                }
                return;
            }
            // The readers meet the error themselves.
            Err(_) => return,
        };
        let block_size = self.inner.store.block_size();
        let count = self.block_count(object);
        let first = (layout.data_start / block_size) as u32;
        let window = (self.readahead().end / block_size).max(1) as u32;
        tracing::debug!(
            file = name,
            tensors = layout.tensors.len(),
            "loading a model ahead of its readers"
        );
        let (mut next_fill, mut next_read) = (first, first);
        let mut reads = FuturesUnordered::new();
        while next_fill < count || next_read < count || !reads.is_empty() {
            let moved = progress.moved.notified();
            let written = self.fills().next_write_end();
            tokio::pin!(moved, written);
            // Registered before the look, so that progress or room made meanwhile wakes us.
            moved.as_mut().enable();
            written.as_mut().enable();
            let allowed = first
                .saturating_add(progress.count.load(Ordering::Relaxed))
                .saturating_add(window)
                .min(count);
            if next_fill < allowed {
                next_fill = self.prefetch_blocks(object, next_fill..allowed);
            }
            while next_read < allowed && reads.len() < DISK_READS_AHEAD {
                let key = (object.id, next_read);
                // Also a block a reader read in part first: checked whole, it lets the next
                // open of the file pass through.
                let store = &self.inner.store;
                let wanted = store.contains(object.id, next_read)
                    && !store.verified(object.id, next_read)
                    && !self.sharing().holds_kept(key);
                // A block read ahead must be kept until its reader comes: else it is read
                // again. The reads in flight will be kept too.
                let reading = block_size * (reads.len() as u64 + 1);
                let room = self.sharing().kept_room(reading, self.keep_room());
                if wanted && !(room && self.room_to_hold()) {
                    break;
                }
                if wanted {
                    let index = next_read;
                    // Shared with a reader that wants the block meanwhile (one disk read).
                    let block = self.spawn_block(object, index);
                    reads.push(async move {
                        if let Ok(block) = block.await {
                            self.keep((object.id, index), &block);
                        }
                    });
                }
                next_read += 1;
            }
            tokio::select! {
                () = self.stopped() => return,
                () = moved => {}
                () = written => {}
                Some(()) = reads.next() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(json: &str) -> Vec<u8> {
        json.as_bytes().to_vec()
    }

    #[test]
    fn a_header_gives_its_tensors_in_file_order() {
        let json = r#"{"__metadata__":{"format":"pt"},
            "b":{"dtype":"F16","shape":[2,3],"data_offsets":[16,28]},
            "a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
        let data_start = 8 + json.len() as u64;
        let layout = parse_header(&header(json), data_start + 28).expect("a good header");
        assert_eq!(layout.data_start, data_start);
        assert_eq!(
            layout.tensors,
            vec![data_start..data_start + 16, data_start + 16..data_start + 28]
        );
    }

    #[test]
    fn a_length_over_the_limit_or_past_the_file_is_refused_before_anything_is_read() {
        let huge = (8u64 << 30).to_le_bytes();
        assert_eq!(header_len(huge, 1 << 40), Err(NotAModel::HeaderTooLarge(8 << 30)));
        let past = 100u64.to_le_bytes();
        assert_eq!(
            header_len(past, 50),
            Err(NotAModel::HeaderPastEnd { len: 100, size: 50 })
        );
        // Text named .safetensors: its first 8 bytes make a length of exabytes.
        let text: [u8; 8] = *b"# Llama\n";
        assert!(matches!(
            header_len(text, 4096),
            Err(NotAModel::HeaderTooLarge(_))
        ));
        assert_eq!(header_len(10u64.to_le_bytes(), 18), Ok(10));
    }

    #[test]
    fn headers_that_are_not_json_of_tensors_are_refused() {
        for json in [
            "not json",
            "[1,2]",
            r#"{"a":{"dtype":"F16"}}"#,
            r#"{"a":{"dtype":"F16","shape":[1],"data_offsets":[0]}}"#,
        ] {
            let refused = parse_header(&header(json), 1 << 20);
            assert!(
                matches!(refused, Err(NotAModel::NotJson(_) | NotAModel::BadTensor { .. })),
                "{json}: {refused:?}"
            );
        }
    }

    #[test]
    fn extents_out_of_range_overlapping_or_of_the_wrong_size_are_refused() {
        let cases = [
            // Past the data region (which is 8 bytes here).
            (
                r#"{"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}"#,
                "outside",
            ),
            // Backwards.
            (
                r#"{"a":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}}"#,
                "outside",
            ),
            // Two tensors on the same bytes.
            (
                r#"{"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}"#,
                "overlap",
            ),
            // Not the size its dtype and shape make.
            (
                r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}"#,
                "make 16",
            ),
            // A shape whose size is past u64 is never the extent's.
            (
                r#"{"a":{"dtype":"F64","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}"#,
                "shape",
            ),
        ];
        for (json, what) in cases {
            let size = 8 + json.len() as u64 + 8;
            let refused = parse_header(&header(json), size).expect_err(json);
            assert!(refused.to_string().contains(what), "{json}: {refused}");
        }
    }

    #[test]
    fn a_dtype_the_format_does_not_name_is_taken_at_its_extent() {
        let json = r#"{"a":{"dtype":"F4_E2M1","shape":[16],"data_offsets":[0,8]}}"#;
        let size = 8 + json.len() as u64 + 8;
        assert_eq!(parse_header(&header(json), size).expect("kept").tensors.len(), 1);
    }
}
