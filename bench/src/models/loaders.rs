//! The Python side (`bench/models/loaders.py`, run by the venv's Python): generating the model
//! files, and running a loader as inference engines do, one process per tensor-parallel rank,
//! all released at once after their imports.

use std::io::{BufRead, BufReader, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The script, relative to the repository root (where the benchmark runs).
const SCRIPT: &str = "bench/models/loaders.py";

/// One of the two models the script writes: the same tensors in one file or in 8 shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Model {
    Single,
    Sharded,
}

impl Model {
    pub(crate) const ALL: [Model; 2] = [Model::Single, Model::Sharded];

    /// The directory of its files, in the generated tree and in the bucket.
    pub(crate) fn dir(self) -> &'static str {
        match self {
            Model::Single => "single",
            Model::Sharded => "sharded",
        }
    }

    /// The file a loader is given: the model file, or the index of the shards.
    fn entry(self) -> &'static str {
        match self {
            Model::Single => "single/model.safetensors",
            Model::Sharded => "sharded/model.safetensors.index.json",
        }
    }

    /// The loader that reads every byte of the model once, for checking them.
    fn reader(self) -> Loader {
        match self {
            Model::Single => Loader::Keys,
            Model::Sharded => Loader::Sharded,
        }
    }
}

/// How a model is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Loader {
    /// `safe_open` + `get_tensor` in `keys()` order (vLLM's default iterator).
    Keys,
    /// 2 tensor-parallel ranks, each `get_slice` of every tensor.
    Tp2,
    /// 4 tensor-parallel ranks.
    Tp4,
    /// `safetensors.numpy.load_file` (transformers).
    LoadFile,
    /// The index, then each shard in key order.
    Sharded,
}

impl Loader {
    pub(crate) const ALL: [Loader; 5] = [
        Loader::Keys,
        Loader::Tp2,
        Loader::Tp4,
        Loader::LoadFile,
        Loader::Sharded,
    ];

    /// Its name in the report's tables.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Loader::Keys => "key order",
            Loader::Tp2 => "TP-2",
            Loader::Tp4 => "TP-4",
            Loader::LoadFile => "load_file",
            Loader::Sharded => "sharded",
        }
    }

    /// What it does, for the report.
    pub(crate) fn description(self) -> &'static str {
        match self {
            Loader::Keys => {
                "`safe_open(path, framework=\"np\")`, then `get_tensor(k)` for each `k` in `keys()` order, as vLLM's default iterator"
            }
            Loader::Tp2 | Loader::Tp4 => {
                "one process per tensor-parallel rank, all at once: `safe_open`, then `get_slice(k)` of every tensor in `keys()` order, keeping the rank's part of each 2-D tensor (o_proj and down_proj along dim 1, the others along dim 0) and the whole of each 1-D tensor"
            }
            Loader::LoadFile => "`safetensors.numpy.load_file(path)`, as transformers loads a checkpoint",
            Loader::Sharded => {
                "`model.safetensors.index.json`, then each of its 8 shards in turn, in `keys()` order with `get_tensor`"
            }
        }
    }

    /// The model it loads.
    pub(crate) fn model(self) -> Model {
        match self {
            Loader::Sharded => Model::Sharded,
            Loader::Keys | Loader::Tp2 | Loader::Tp4 | Loader::LoadFile => Model::Single,
        }
    }

    /// Processes that load at once.
    pub(crate) fn ranks(self) -> usize {
        match self {
            Loader::Tp2 => 2,
            Loader::Tp4 => 4,
            Loader::Keys | Loader::LoadFile | Loader::Sharded => 1,
        }
    }

    /// The script's name for it.
    fn arg(self) -> &'static str {
        match self {
            Loader::Keys => "keys",
            Loader::Tp2 | Loader::Tp4 => "tp",
            Loader::LoadFile => "load-file",
            Loader::Sharded => "sharded",
        }
    }
}

/// What the script says of the model it wrote.
#[derive(Debug, Clone, Copy, serde::Deserialize)]
pub(crate) struct Shape {
    pub(crate) layers: u32,
    pub(crate) hidden: u32,
    pub(crate) intermediate: u32,
    pub(crate) vocab: u32,
    pub(crate) tensors: u64,
    pub(crate) tensor_bytes: u64,
}

/// What one rank says it loaded.
#[derive(Debug, serde::Deserialize)]
struct RankResult {
    tensors: u64,
    bytes: u64,
    cpu_seconds: f64,
}

/// What one load did, all its ranks together.
#[derive(Debug)]
pub(crate) struct Loaded {
    /// From the ranks' release until the last one said it was done.
    pub(crate) elapsed: Duration,
    /// Tensors each rank loaded (every rank loads a part of every tensor).
    pub(crate) tensors: u64,
    /// Bytes of the tensors (and the ranks' parts of them) loaded, all ranks together.
    pub(crate) bytes: u64,
    /// CPU seconds the ranks spent loading, together.
    pub(crate) cpu: f64,
}

/// The Python that runs the script.
#[derive(Debug)]
pub(crate) struct Python {
    bin: PathBuf,
}

impl Python {
    /// `bin`, checked to have the script and the libraries at hand.
    pub(crate) fn new(bin: PathBuf) -> anyhow::Result<Self> {
        anyhow::ensure!(
            Path::new(SCRIPT).is_file(),
            "{SCRIPT} is not here: run the benchmark from the repository root"
        );
        let status = Command::new(&bin)
            .args(["-c", "import numpy, safetensors"])
            .status()
            .with_context(|| format!("cannot run {}: run bench/setup, or pass --python", bin.display()))?;
        anyhow::ensure!(
            status.success(),
            "{} cannot import safetensors and numpy: run bench/setup",
            bin.display()
        );
        Ok(Self { bin })
    }

    /// The version of the safetensors library, for the report.
    pub(crate) fn safetensors_version(&self) -> String {
        Command::new(&self.bin)
            .args(["-c", "import safetensors; print(safetensors.__version__)"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    }

    /// Writes both models of about `size` bytes under `out`.
    pub(crate) fn generate(&self, out: &Path, size: u64) -> anyhow::Result<Shape> {
        let output = Command::new(&self.bin)
            .arg(SCRIPT)
            .arg("generate")
            .arg("--out")
            .arg(out)
            .args(["--size", &size.to_string()])
            .stderr(Stdio::inherit())
            .output()
            .context("running the model generator")?;
        anyhow::ensure!(
            output.status.success(),
            "generating the models: {}",
            output.status
        );
        serde_json::from_slice(&output.stdout).context("reading what the generator wrote")
    }

    /// Loads the model `loader` reads from the tree at `root`: its ranks are started, and
    /// released together once every one has imported its libraries.
    pub(crate) fn load(&self, loader: Loader, root: &Path) -> anyhow::Result<Loaded> {
        let world = loader.ranks();
        let mut ranks = Ranks(Vec::new());
        for rank in 0..world {
            let mut command = self.loader(loader, root);
            command.arg("--ready");
            if world > 1 {
                command
                    .args(["--rank", &rank.to_string()])
                    .args(["--world", &world.to_string()]);
            }
            ranks.0.push(Rank::spawn(command)?);
        }
        for rank in &mut ranks.0 {
            let line = rank.line()?;
            anyhow::ensure!(line == "ready", "a {} rank said {line:?}", loader.name());
        }
        let started = Instant::now();
        for rank in &mut ranks.0 {
            let mut stdin = rank.child.stdin.take().context("no stdin")?;
            stdin.write_all(b"go\n")?;
        }
        let mut results = Vec::new();
        for rank in &mut ranks.0 {
            results.push(rank.line()?);
        }
        let elapsed = started.elapsed();
        for rank in &mut ranks.0 {
            rank.finish()?;
        }
        let mut loaded = Loaded {
            elapsed,
            tensors: 0,
            bytes: 0,
            cpu: 0.0,
        };
        for line in results {
            let result: RankResult =
                serde_json::from_str(&line).with_context(|| format!("a rank's result: {line:?}"))?;
            anyhow::ensure!(
                loaded.tensors == 0 || loaded.tensors == result.tensors,
                "the ranks loaded {} and {} tensors",
                loaded.tensors,
                result.tensors
            );
            loaded.tensors = result.tensors;
            loaded.bytes += result.bytes;
            loaded.cpu += result.cpu_seconds;
        }
        Ok(loaded)
    }

    /// Reads every tensor of `model` from the tree at `root` and checks it against the same
    /// one in the tree at `reference`: a system that serves wrong bytes fails instead of being
    /// measured.
    pub(crate) fn check(&self, model: Model, root: &Path, reference: &Path) -> anyhow::Result<()> {
        let mut command = self.loader(model.reader(), root);
        command.arg("--compare").arg(reference.join(model.dir()));
        let mut rank = Rank::spawn(command)?;
        rank.line()?;
        rank.finish()
    }

    /// The command that runs `loader` on its model in the tree at `root`.
    fn loader(&self, loader: Loader, root: &Path) -> Command {
        let mut command = Command::new(&self.bin);
        command
            .arg(SCRIPT)
            .args(["load", loader.arg()])
            .arg(root.join(loader.model().entry()));
        command
    }
}

/// A loader's process, its output read a line at a time and its errors kept in a file.
struct Rank {
    child: Child,
    stdout: BufReader<ChildStdout>,
    stderr: std::fs::File,
}

impl Rank {
    fn spawn(mut command: Command) -> anyhow::Result<Self> {
        let stderr = tempfile::tempfile()?;
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr.try_clone()?)
            .spawn()
            .context("starting a loader")?;
        let stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        Ok(Self {
            child,
            stdout,
            stderr,
        })
    }

    /// The next line the process writes; its errors if it ends first.
    fn line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let status = self.child.wait()?;
            bail!("a loader exited with {status}: {}", self.errors());
        }
        Ok(line.trim_end().to_owned())
    }

    /// Waits for the process, which must succeed.
    fn finish(&mut self) -> anyhow::Result<()> {
        let status = self.child.wait()?;
        anyhow::ensure!(
            status.success(),
            "a loader exited with {status}: {}",
            self.errors()
        );
        Ok(())
    }

    /// What the process wrote to its standard error.
    fn errors(&mut self) -> String {
        let mut text = String::new();
        let _ = self.stderr.rewind();
        let _ = self.stderr.read_to_string(&mut text);
        text.trim().to_owned()
    }
}

/// The ranks of one load; dropped (a load that failed half way), those still running are
/// killed.
struct Ranks(Vec<Rank>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for rank in &mut self.0 {
            if let Ok(None) = rank.child.try_wait() {
                let _ = rank.child.kill();
                let _ = rank.child.wait();
            }
        }
    }
}
