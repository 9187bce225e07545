//! The progress lines a benchmark through mounts prints, and the runs that failed, each with
//! what its system's log says: a failed run is reported and the benchmark goes on.

use std::time::{Duration, Instant};

use super::systems::{Setup, System};

/// Progress and failures of one benchmark run.
#[derive(Debug)]
pub(crate) struct RunLog {
    started: Instant,
    failures: Vec<String>,
}

impl RunLog {
    /// A log of a run that starts now: its lines count the seconds since.
    pub(crate) fn start() -> Self {
        Self {
            started: Instant::now(),
            failures: Vec::new(),
        }
    }

    /// The time since the run started.
    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Prints a progress line.
    pub(crate) fn progress(&self, what: &str) {
        eprintln!("[{:4.0} s] {what}", self.elapsed().as_secs_f64());
    }

    /// Runs `round` `count` times, numbered from 0, each after a line saying which it is.
    pub(crate) fn rounds<R>(&mut self, count: usize, mut round: impl FnMut(usize, &mut Self) -> R) -> Vec<R> {
        (0..count)
            .map(|number| {
                eprintln!("round {}/{count}", number + 1);
                round(number, self)
            })
            .collect()
    }

    /// What a run of `run` (the limit, or one of `setups`) in round `number` (from 0) gave, or
    /// None after reporting its failure with the lines of its system's log that tell why.
    pub(crate) fn outcome<T>(
        &mut self,
        number: usize,
        run: System,
        setups: &[Setup],
        outcome: anyhow::Result<T>,
    ) -> Option<T> {
        let error = match outcome {
            Ok(value) => return Some(value),
            Err(error) => error,
        };
        let setup = setups.iter().find(|setup| setup.system == run);
        let log = setup.map(Setup::log_trouble).unwrap_or_default();
        let log: String = log.iter().map(|line| format!("\n    log: {line}")).collect();
        let failure = format!("round {}, {}: {error:#}{log}", number + 1, run.name());
        self.progress(&failure);
        self.failures.push(failure);
        None
    }

    /// The failures so far.
    pub(crate) fn failures(&self) -> &[String] {
        &self.failures
    }

    /// Fails if a run did.
    pub(crate) fn finish(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.failures.is_empty(), "{} runs failed", self.failures.len());
        Ok(())
    }
}
