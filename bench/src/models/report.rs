//! The markdown report of the models benchmark: a summary of each load's ratio to its
//! reference, then one table per loader and phase with every figure, each the median of the
//! rounds with its min–max.

use std::fmt::Write;

use larder_config::OriginConfig;

use super::loaders::{Loader, Model, Shape};
use super::{Phase, Round};
use crate::ModelsArgs;
use crate::common::{machine, number, ratio, spread, utc_now};
use crate::mount::Sample;
use crate::mount::report::{COST_HEAD, COST_RULE, Run, cost_cells};
use crate::mount::systems::System;

const MIB: f64 = (1u64 << 20) as f64;

/// What the report is made of.
#[derive(Debug)]
pub(crate) struct Context<'a> {
    pub(crate) args: &'a ModelsArgs,
    pub(crate) shape: &'a Shape,
    /// The bytes of each model's files.
    pub(crate) model_bytes: [(Model, u64); 2],
    /// The version of the safetensors library the loaders ran.
    pub(crate) safetensors: String,
    pub(crate) rounds: &'a [Round],
    pub(crate) run: Run<'a>,
}

impl Phase {
    /// What the systems do before and during the load.
    fn title(self) -> &'static str {
        match self {
            Phase::Cold => "cache wiped, page cache dropped, mount started, then the load",
            Phase::Warm => {
                "the mount restarted on the cache its cold load filled, page cache dropped: the first load after a restart (Larder checks each block on its first read after a start, so this load goes through the daemon)"
            }
            Phase::Again => {
                "page cache dropped, the same load again on the same mount (Larder hands the kernel its cached file: FUSE passthrough)"
            }
        }
    }

    /// What the reference does.
    fn reference(self) -> String {
        match self {
            Phase::Cold => {
                let origin = OriginConfig::default();
                format!(
                    "a raw parallel download of the model's files through the same proxy ({} ranged GETs of {} in flight, across the files)",
                    origin.concurrency, origin.part_size
                )
            }
            Phase::Warm | Phase::Again => {
                "the same loader on the local copy of the files, page cache dropped".to_owned()
            }
        }
    }
}

impl Context<'_> {
    /// `system`'s samples of a load, one per round where it has one.
    fn samples(&self, loader: Loader, phase: Phase, system: System) -> Vec<&Sample> {
        self.rounds
            .iter()
            .filter_map(|round| round.get(&(loader, phase, system)))
            .collect()
    }

    /// How many times faster `a` loaded than `b`, in each round where both have a load.
    fn ratios(&self, loader: Loader, phase: Phase, a: System, b: System) -> Vec<f64> {
        self.rounds
            .iter()
            .filter_map(|round| {
                let a = round.get(&(loader, phase, a))?.work.elapsed;
                let b = round.get(&(loader, phase, b))?.work.elapsed;
                Some(b.as_secs_f64() / a.as_secs_f64())
            })
            .collect()
    }

    fn mounts(&self) -> impl Iterator<Item = System> + '_ {
        self.run.versions.iter().map(|(s, _)| *s)
    }

    fn loads() -> impl Iterator<Item = (Loader, Phase)> {
        Loader::ALL
            .into_iter()
            .flat_map(|loader| Phase::ALL.map(|phase| (loader, phase)))
    }

    fn summary_table(&self, out: &mut String) {
        let _ = write!(out, "| load | reference s |");
        for system in self.mounts() {
            let _ = write!(out, " {} ÷ reference |", system.name());
        }
        let _ = writeln!(out, "\n|---|---|{}", "---|".repeat(self.mounts().count()));
        for (loader, phase) in Self::loads() {
            let seconds = self.samples(loader, phase, System::Limit);
            let seconds = seconds.iter().map(|s| s.work.elapsed.as_secs_f64()).collect();
            let _ = write!(
                out,
                "| {}, {} | {} |",
                loader.name(),
                phase.name(),
                spread(seconds, number)
            );
            for system in self.mounts() {
                let ratios = self.ratios(loader, phase, system, System::Limit);
                let _ = write!(out, " {} |", spread(ratios, ratio));
            }
            let _ = writeln!(out);
        }
    }

    fn load_table(&self, loader: Loader, phase: Phase, out: &mut String) {
        let _ = writeln!(
            out,
            "\n### {}, {}\n\n{}; {}.\nReference: {}.\n",
            loader.name(),
            phase.name(),
            loader.description(),
            phase.title(),
            phase.reference()
        );
        let _ = writeln!(
            out,
            "| system | s | MiB/s | ÷ reference | Larder ÷ system |{COST_HEAD}"
        );
        let _ = writeln!(out, "|---|---|---|---|---|{COST_RULE}");
        for system in std::iter::once(System::Limit).chain(self.mounts()) {
            let samples = self.samples(loader, phase, system);
            if samples.is_empty() {
                continue;
            }
            let seconds = samples.iter().map(|s| s.work.elapsed.as_secs_f64());
            let throughput = samples
                .iter()
                .map(|s| s.work.bytes as f64 / MIB / s.work.elapsed.as_secs_f64());
            let to_reference = match system {
                System::Limit => "1".to_owned(),
                _ => spread(self.ratios(loader, phase, system, System::Limit), ratio),
            };
            let larder_to = match system {
                System::Rclone | System::S3fs => {
                    spread(self.ratios(loader, phase, System::Larder, system), ratio)
                }
                System::Limit | System::Larder => "—".to_owned(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {to_reference} | {larder_to} |{}",
                if system == System::Limit {
                    "reference"
                } else {
                    system.name()
                },
                spread(seconds.collect(), number),
                spread(throughput.collect(), number),
                cost_cells(&samples),
            );
        }
    }
}

/// The whole report.
pub(crate) fn render(cx: &Context<'_>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# Models benchmark\n");
    let _ = writeln!(out, "{}; {}", utc_now(), machine());
    let shape = cx.shape;
    let bytes = |model: Model| {
        cx.model_bytes
            .iter()
            .find(|(m, _)| *m == model)
            .map_or(0, |(_, bytes)| *bytes)
    };
    let _ = writeln!(
        out,
        "model of {} (`--size`): a Llama-shaped transformer of {} layers (hidden {}, MLP {}, \
         vocabulary {}), {} tensors, F16 weights, F32 norms, every fourth layer's MLP in I8 and \
         U8 with F32 and F16 scales; one file of {} bytes, and the same tensors in 8 shards with \
         their index, {} bytes; safetensors {} (numpy); {}",
        cx.args.size,
        shape.layers,
        shape.hidden,
        shape.intermediate,
        shape.vocab,
        shape.tensors,
        bytes(Model::Single),
        bytes(Model::Sharded),
        cx.safetensors,
        cx.run.note(cx.rounds.len()),
    );
    cx.run.describe_systems(&mut out);
    let _ = writeln!(
        out,
        "\nEach load is one or more Python processes (`bench/models/loaders.py`) that copy every \
         tensor they load out of what the library returns; the clock runs from releasing them, \
         once Python and its imports are up, until the last one is done."
    );
    let _ = writeln!(
        out,
        "\n## Load speed as a ratio to the reference (reference time ÷ load time; higher is better)\n"
    );
    cx.summary_table(&mut out);
    let _ = writeln!(
        out,
        "\n## Per load\n\nTimes and ratios are medians of per-round values. CPU is user + system \
         time of the mount process (`/proc/PID/stat`), of the loader processes (their own count) \
         and of the object store's server during the load, per GiB of the model's files; peak RSS \
         is the mount process's VmHWM, reset before each load; origin figures count requests of \
         every kind and the object bytes GETs asked for, per GiB of the model's files (1.00: each \
         byte fetched once)."
    );
    for (loader, phase) in Context::loads() {
        cx.load_table(loader, phase, &mut out);
    }
    cx.run.failed_runs(&mut out);
    out
}
