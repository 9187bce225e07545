//! A sharded model loaded through the mount with the real `safetensors` library (PyPI, with
//! numpy, in bench/.venv, installed by scripts/test), as inference engines load one: the
//! index, then each shard in turn, each tensor in key order (vLLM's iterator) and each rank's
//! slice of it (tensor parallelism). Every tensor is compared with the same tensor loaded from
//! the bucket's own copy: cold, warm, and after a restart (with no GET of the origin then).

use std::path::Path;
use std::process::Command;

use larder_tests::S3Server;
use larder_tests::daemon::DaemonProcess;

const BIN: &str = env!("CARGO_BIN_EXE_larder");

fn python() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/.venv/bin/python3")
}

/// Writes a model of three shards and its index under `dir`, as `save_pretrained` does: the
/// dtypes a checkpoint holds (F16 and BF16-sized weights, F32 norms, I8 and U8 quantized
/// blocks), shapes of a small transformer.
const GENERATE: &str = r#"
import json, os, sys
import numpy as np
from safetensors.numpy import save_file
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(7)
weight_map = {}
shards = 3
for shard in range(1, shards + 1):
    name = f"model-{shard:05d}-of-{shards:05d}.safetensors"
    tensors = {}
    for layer in range(2):
        p = f"model.layers.{(shard - 1) * 2 + layer}"
        tensors[f"{p}.self_attn.q_proj.weight"] = rng.standard_normal((768, 512)).astype(np.float16)
        tensors[f"{p}.self_attn.o_proj.weight"] = rng.standard_normal((512, 768)).astype(np.float16)
        tensors[f"{p}.mlp.up_proj.weight"] = rng.integers(-128, 127, (1024, 512), dtype=np.int8)
        tensors[f"{p}.mlp.down_proj.scales"] = rng.integers(0, 255, (333,), dtype=np.uint8)
        tensors[f"{p}.input_layernorm.weight"] = rng.standard_normal(512).astype(np.float32)
    if shard == 1:
        tensors["model.embed_tokens.weight"] = rng.standard_normal((1000, 512)).astype(np.float16)
    save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
    weight_map.update({k: name for k in tensors})
with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
"#;

/// Loads the model at argv[1] as engines do and compares every tensor, and every rank's slice
/// of it, with the copy at argv[2]; prints how many tensors it compared.
const LOAD: &str = r#"
import json, os, sys
import numpy as np
from safetensors import safe_open
mount, origin = sys.argv[1], sys.argv[2]
index = json.load(open(os.path.join(mount, "model.safetensors.index.json")))
compared = 0
for shard in sorted(set(index["weight_map"].values())):
    with safe_open(os.path.join(mount, shard), framework="np") as got, \
         safe_open(os.path.join(origin, shard), framework="np") as want:
        assert list(got.keys()) == list(want.keys()), shard
        for key in got.keys():
            a, b = got.get_tensor(key), want.get_tensor(key)
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                sys.exit(f"{shard}: tensor {key} differs")
            sliced = got.get_slice(key)
            rows = sliced.get_shape()[0]
            for rank in range(2):
                part = sliced[rank * rows // 2:(rank + 1) * rows // 2]
                if part.tobytes() != b[rank * rows // 2:(rank + 1) * rows // 2].tobytes():
                    sys.exit(f"{shard}: rank {rank}'s slice of {key} differs")
            compared += 1
print(compared)
"#;

fn run_python(script: &str, args: &[&Path]) -> String {
    let output = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("python3 with safetensors and numpy (scripts/test installs them in bench/.venv)");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sharded_model_loads_through_the_mount_as_engines_load_it_cold_warm_and_after_a_restart() {
    let server = S3Server::start("larder-test").await.expect("s3 server");
    let origin_copy = server.bucket_dir().join("llama");
    run_python(GENERATE, &[&origin_copy]);
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("daemon");
    let model = daemon.mount.join("llama");
    let load = |model: &Path| {
        let (model, origin) = (model.to_owned(), origin_copy.clone());
        tokio::task::spawn_blocking(move || run_python(LOAD, &[&model, &origin]))
    };
    // Cold, then warm (the page cache and passthrough).
    for round in ["cold", "warm"] {
        let compared = load(&model).await.expect("join");
        assert_eq!(compared.trim(), "31", "{round}");
    }
    let gets = server.ranged_gets().len();
    assert!(gets > 0);
    daemon.stop().expect("stop");

    let daemon = DaemonProcess::start(Path::new(BIN), &server, dir.path(), &[]).expect("restart");
    let compared = load(&daemon.mount.join("llama")).await.expect("join");
    assert_eq!(compared.trim(), "31", "after a restart");
    assert_eq!(
        server.ranged_gets().len(),
        gets,
        "the model was fetched again after a restart"
    );
}
