//! `larder containerd-config`: the `hosts.toml` files that make containerd pull the configured
//! registries through the node's mirror, and straight from the registry when the mirror does
//! not answer (containerd tries the hosts in order, then the `server`).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use anyhow::{Context, bail};
use larder_config::ConfigArgs;

/// Arguments of `larder containerd-config`.
#[derive(Debug, Clone, clap::Args)]
pub struct ContainerdConfigArgs {
    /// The daemon's configuration: its `[registry]` table says what to write.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Write `DIR/<registry>/hosts.toml` for each upstream (containerd's `config_path`, e.g.
    /// /etc/containerd/certs.d); without it, print them.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// The `hosts.toml` of registry `host`, reached at `server`, through the mirror at `mirror`.
pub fn hosts_toml(host: &str, server: &str, mirror: SocketAddr) -> String {
    // An unspecified listen address is reached at loopback on the node.
    let mirror = match mirror.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), mirror.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), mirror.port()),
        _ => mirror,
    };
    format!(
        "# Written by `larder containerd-config`: pulls of {host} go through the node's Larder\n\
         # mirror first, and to the registry itself when the mirror does not answer.\n\
         server = \"{server}\"\n\
         \n\
         [host.\"http://{mirror}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
    )
}

/// Runs `larder containerd-config`.
pub fn run(args: ContainerdConfigArgs) -> anyhow::Result<()> {
    let config = args.config.load_sources_optional()?;
    let registry = &config.registry;
    let Some(mirror) = registry.listen else {
        bail!(
            "the registry mirror is off (registry.listen = \"off\"): there is nothing to point containerd at"
        );
    };
    if registry.upstreams.is_empty() {
        bail!("no registry is configured upstream (registry.upstreams): there is nothing to write");
    }
    for upstream in &registry.upstreams {
        let text = hosts_toml(&upstream.host, &upstream.url, mirror);
        match &args.dir {
            Some(dir) => {
                let dir = dir.join(&upstream.host);
                std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
                let path = dir.join("hosts.toml");
                std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
                println!("{}", path.display());
            }
            None => println!("# {}/hosts.toml\n{text}", upstream.host),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_toml_puts_the_mirror_first_and_the_registry_as_server() {
        let text = hosts_toml("nvcr.io", "https://nvcr.io", "0.0.0.0:7471".parse().unwrap());
        let parsed: toml::Value = toml::from_str(&text).unwrap();
        assert_eq!(parsed["server"].as_str(), Some("https://nvcr.io"));
        let host = &parsed["host"]["http://127.0.0.1:7471"];
        assert_eq!(host["capabilities"].as_array().unwrap().len(), 2, "{text}");
    }
}
