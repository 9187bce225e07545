//! The sequential detector of one reader: a pure state machine, fed the range of each read,
//! that says whether the read continues a run and which bytes to start fetching ahead.
//!
//! The kernel's own readahead sends several requests at once, a few MiB apart and not always
//! in order, so a read continues a run when it starts within `2 × min` of where the run has got
//! to. That slack does not grow with the window: reads that jump around a file must not keep
//! counting as a run once one has started. A run costs whole blocks read and fetched ahead, so
//! it starts only at the object's start (as the kernel's own readahead starts there, whatever
//! came before) or with the second read in a row that starts within
//! [`RUN_START_SLACK`] of the end of the one before. One such read is what random reads over a
//! file make now and then (two reads of 4 KiB at random in 512 MiB fall within 1 MiB of each
//! other one time in 256); two in a row they almost never make. While the run goes on the
//! window doubles from `min` to `max`; a jump ends the run.

use std::ops::Range;

/// How far from the end of the last read a read may start and still start a run: one
/// request of the kernel's readahead, which may overtake the one before it.
pub const RUN_START_SLACK: u64 = 1 << 20;

/// What one read means for the reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The read is part of a run (the window is open).
    pub sequential: bool,
    /// This read started the run; `ended` says a jump ended one.
    pub started: bool,
    /// This read ended a run.
    pub ended: bool,
    /// Bytes to start fetching ahead (never overlapping what an earlier step asked for).
    pub prefetch: Option<Range<u64>>,
}

/// The detector's state.
#[derive(Debug, Clone)]
pub struct Readahead {
    min: u64,
    max: u64,
    /// Where the run has got to: the furthest end of a read in it.
    next_offset: u64,
    /// The readahead window; 0 outside a run.
    window: u64,
    /// Bytes up to here were already asked for.
    prefetched_to: u64,
    /// Outside a run: the last read started next to the end of the one before it, so one more
    /// such read starts a run.
    next_to_last: bool,
}

impl Readahead {
    /// A detector whose window grows from `window.start` to `window.end` bytes.
    pub fn new(window: Range<u64>) -> Self {
        Self {
            min: window.start.max(1),
            max: window.end.max(window.start.max(1)),
            next_offset: 0,
            window: 0,
            prefetched_to: 0,
            next_to_last: false,
        }
    }

    /// The current window (0 outside a run).
    pub fn window(&self) -> u64 {
        self.window
    }

    /// Whether a read starting at `offset` would continue (or start) a run.
    pub fn continues(&self, offset: u64) -> bool {
        if self.window > 0 {
            return self.next_to(offset, 2 * self.min);
        }
        offset == 0 || self.next_to_last && self.next_to(offset, RUN_START_SLACK)
    }

    /// Whether `offset` is within `slack` of where the reads have got to.
    fn next_to(&self, offset: u64, slack: u64) -> bool {
        offset.abs_diff(self.next_offset) <= slack
    }

    /// Feeds a read of `range` of an object of `size` bytes.
    pub fn on_read(&mut self, range: Range<u64>, size: u64) -> Step {
        let was_in_run = self.window > 0;
        if self.continues(range.start) {
            self.window = (self.window * 2).clamp(self.min, self.max);
            // A run started at the object's start owes nothing to where the reads were.
            let from_start = range.start == 0 && !was_in_run;
            self.next_offset = if from_start {
                range.end
            } else {
                self.next_offset.max(range.end)
            };
        } else {
            self.next_to_last = !was_in_run && self.next_to(range.start, RUN_START_SLACK);
            self.window = 0;
            self.prefetched_to = 0;
            self.next_offset = range.end;
        }
        let sequential = self.window > 0;
        let mut prefetch = None;
        if sequential {
            let from = self.prefetched_to.max(range.end);
            let to = range.end.saturating_add(self.window).min(size);
            if to > from {
                prefetch = Some(from..to);
                self.prefetched_to = to;
            }
        }
        Step {
            sequential,
            started: sequential && !was_in_run,
            ended: was_in_run && !sequential,
            prefetch,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const SIZE: u64 = 1 << 40;

    fn detector() -> Readahead {
        Readahead::new(8 * MIB..64 * MIB)
    }

    #[test]
    fn a_sequential_read_doubles_the_window_up_to_the_max() {
        let mut ra = detector();
        let mut windows = Vec::new();
        for i in 0..6 {
            let step = ra.on_read(i * MIB..(i + 1) * MIB, SIZE);
            assert!(step.sequential);
            assert_eq!(step.started, i == 0);
            windows.push(ra.window() / MIB);
        }
        assert_eq!(windows, [8, 16, 32, 64, 64, 64]);
    }

    #[test]
    fn prefetch_ranges_follow_each_other_without_overlap() {
        let mut ra = detector();
        let first = ra.on_read(0..MIB, SIZE).prefetch;
        assert_eq!(first, Some(MIB..9 * MIB));
        let second = ra.on_read(MIB..2 * MIB, SIZE).prefetch;
        assert_eq!(second, Some(9 * MIB..18 * MIB));
        // A read already covered by what was asked for asks for nothing new below it.
        let third = ra.on_read(2 * MIB..3 * MIB, SIZE).prefetch;
        assert_eq!(third, Some(18 * MIB..35 * MIB));
    }

    #[test]
    fn prefetch_stops_at_the_end_of_the_object() {
        let mut ra = detector();
        assert_eq!(ra.on_read(0..MIB, 3 * MIB).prefetch, Some(MIB..3 * MIB));
        assert_eq!(ra.on_read(MIB..2 * MIB, 3 * MIB).prefetch, None);
    }

    #[test]
    fn a_jump_ends_the_run_and_far_reads_never_start_one() {
        let mut ra = detector();
        ra.on_read(0..MIB, SIZE);
        let step = ra.on_read(500 * MIB..500 * MIB + 4096, SIZE);
        assert!(!step.sequential && step.ended);
        assert_eq!(ra.window(), 0);
        // Random reads, each far from the last: never a run.
        for offset in [7 * MIB, 300 * MIB, 90 * MIB, 2 * MIB] {
            let step = ra.on_read(offset..offset + 4096, SIZE);
            assert!(!step.sequential, "{offset}");
            assert_eq!(step.prefetch, None);
        }
    }

    #[test]
    fn out_of_order_reads_within_the_slack_continue_a_run() {
        let mut ra = detector();
        ra.on_read(0..MIB, SIZE);
        // The kernel's readahead: a later request overtakes an earlier one.
        assert!(ra.on_read(3 * MIB..4 * MIB, SIZE).sequential);
        assert!(ra.on_read(MIB..2 * MIB, SIZE).sequential);
        // 2 × min past where the run got to is still the run; further is a jump.
        assert!(ra.on_read(4 * MIB + 16 * MIB..21 * MIB, SIZE).sequential);
        assert!(!ra.on_read(21 * MIB + 16 * MIB + 1..40 * MIB, SIZE).sequential);
    }

    #[test]
    fn a_run_starts_with_the_second_read_in_a_row_next_to_the_last() {
        let mut ra = detector();
        ra.on_read(100 * MIB..100 * MIB + 4096, SIZE);
        assert!(!ra.on_read(102 * MIB..102 * MIB + 4096, SIZE).sequential);
        // Next to the last read: once is not a run, twice in a row is.
        let next = 102 * MIB + 4096 + RUN_START_SLACK;
        assert!(!ra.on_read(next..next + 4096, SIZE).sequential);
        assert!(ra.continues(next + 4096));
        assert!(ra.on_read(next + 4096..next + 8192, SIZE).started);
        // A read next to the last after a jump: not a run either.
        ra.on_read(400 * MIB..400 * MIB + 4096, SIZE);
        ra.on_read(200 * MIB..200 * MIB + 4096, SIZE);
        assert!(!ra.continues(200 * MIB + 4096));
        assert!(!ra.on_read(200 * MIB + 4096..200 * MIB + 8192, SIZE).sequential);
        // A read at the start is one, wherever the reads were, and the run goes on from there.
        assert!(ra.on_read(0..4096, SIZE).started);
        assert!(ra.continues(4096));
    }

    #[test]
    fn random_reads_that_fall_next_to_each_other_once_never_start_a_run() {
        let mut ra = detector();
        // Pairs of reads next to each other, each pair far from the last.
        for pair in 1..20 {
            let offset = pair * 37 * MIB;
            assert!(!ra.on_read(offset..offset + 4096, SIZE).sequential);
            let next = offset + 4096 + MIB / 2;
            assert!(!ra.on_read(next..next + 4096, SIZE).sequential, "pair {pair}");
        }
    }
}
