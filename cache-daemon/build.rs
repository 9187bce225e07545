//! Names the commit the binary is built from, for `larder_build_info`: `LARDER_REVISION` when
//! set (an image built without the repository's history), else `git rev-parse`, else
//! "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let output = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    (output.status.success() && !text.trim().is_empty()).then(|| text.trim().to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=LARDER_REVISION");
    let revision = std::env::var("LARDER_REVISION").ok().or_else(|| {
        // Built again when HEAD moves: HEAD names a branch whose ref file changes on commit.
        let dir = git(&["rev-parse", "--absolute-git-dir"])?;
        println!("cargo:rerun-if-changed={dir}/HEAD");
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            println!("cargo:rerun-if-changed={dir}/{branch}");
        }
        git(&["rev-parse", "--short=12", "HEAD"])
    });
    println!(
        "cargo:rustc-env=LARDER_REVISION={}",
        revision.as_deref().unwrap_or("unknown")
    );
}
