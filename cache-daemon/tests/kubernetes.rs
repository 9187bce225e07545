//! The Kubernetes manifests of `deploy/kubernetes`, checked four ways:
//! - against the Kubernetes schemas, offline (`kubernetes-validate --strict` in a network
//!   namespace of its own, so it cannot fetch anything);
//! - through kustomize (`kubectl kustomize`, offline too): the kustomizations render every
//!   manifest, unchanged;
//! - for what schemas miss: propagation modes and privileges, the node's network and the
//!   registry mirror on its loopback, the host paths of the mount, the cache, the control
//!   socket and containerd's hosts dir as the DaemonSet, the example pod and the prefetch Job
//!   see them, probe and scrape ports, the peer Service, the grace period, the update strategy,
//!   the priority and Pod Security level, images by digest, the config itself, and the Grafana
//!   dashboard ConfigMap against `deploy/grafana/larder.json`;
//! - by running them: `larder daemon` started with the DaemonSet container's exact arguments,
//!   environment and ConfigMap, against SeaweedFS, each container path replaced by a local
//!   directory standing for its volume (a hostPath by the same directory wherever it is
//!   mounted), and only what must be local replaced besides (the bucket, the registry's
//!   address, listen addresses, the peer DNS name, the secrets' values, the API server); then
//!   the prefetch Job's and the example pod's containers run as written against that node, and
//!   a real containerd pulls an image through the mirror by the hosts dir the daemon keeps.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use larder_config::Config;
use larder_control_api::Plan;
use larder_tests::kube::{ApiServer, manifest_dir, manifests, venv_bin, yaml_documents};
use larder_tests::oci::{Containerd, Registry, TestImage, is_blob_get, push};
use larder_tests::seaweed::Seaweed;
use larder_tests::{Bucket, RecordingProxy, content, seed, upload};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_larder");
const MIB: u64 = 1 << 20;

/// The manifests by kind and name.
struct Manifests(BTreeMap<(String, String), Value>);

impl Manifests {
    fn load() -> Self {
        let mut all = BTreeMap::new();
        for (path, documents) in manifests(&manifest_dir()).expect("manifests") {
            for document in documents {
                let kind = document["kind"].as_str().expect("kind").to_owned();
                let name = document["metadata"]["name"].as_str().expect("name").to_owned();
                let file = path.display();
                assert!(
                    all.insert((kind.clone(), name.clone()), document).is_none(),
                    "{kind} {name} twice ({file})"
                );
            }
        }
        Self(all)
    }

    fn get(&self, kind: &str, name: &str) -> &Value {
        self.0
            .get(&(kind.to_owned(), name.to_owned()))
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    }

    fn daemonset(&self) -> &Value {
        self.get("DaemonSet", "larder")
    }

    /// The daemon's config, as the ConfigMap holds it.
    fn config(&self) -> Config {
        let text = self.get("ConfigMap", "larder-config")["data"]["larder.toml"]
            .as_str()
            .expect("larder.toml");
        Config::from_toml_str(text).expect("larder.toml parses")
    }
}

fn str_of(value: &Value) -> &str {
    value.as_str().unwrap_or_else(|| panic!("not a string: {value}"))
}

/// A container of a pod spec, by name.
fn container<'a>(spec: &'a Value, name: &str) -> &'a Value {
    ["containers", "initContainers"]
        .iter()
        .filter_map(|list| spec[list].as_array())
        .flatten()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// Where a container path is on the node: the volume it is under, and if that volume is a
/// hostPath, the host path. `(volume name, Some(host path) or None, path below the mount)`.
fn on_node(spec: &Value, container: &Value, path: &Path) -> (String, Option<PathBuf>, PathBuf) {
    let (mount, below) = container["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .filter_map(|m| {
            let below = path.strip_prefix(str_of(&m["mountPath"])).ok()?;
            Some((m, below.to_owned()))
        })
        .max_by_key(|(m, _)| str_of(&m["mountPath"]).len())
        .unwrap_or_else(|| panic!("{} is on no volume of {}", path.display(), container["name"]));
    let name = str_of(&mount["name"]).to_owned();
    let volume = spec["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == name.as_str())
        .unwrap_or_else(|| panic!("no volume {name}"));
    let host = volume["hostPath"]["path"].as_str().map(PathBuf::from);
    (name, host, below)
}

/// The value of `--flag=VALUE` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> &'a str {
    let prefix = format!("--{name}=");
    args.iter()
        .find_map(|a| a.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in {args:?}"))
}

fn args_of(container: &Value) -> Vec<String> {
    container["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| str_of(a).to_owned())
        .collect()
}

fn port_named(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no port {name}"))
}

#[test]
fn kubernetes_manifests_pass_the_schemas_offline() {
    let validate = venv_bin().join("kubernetes-validate");
    assert!(
        validate.exists(),
        "{} is missing: run scripts/test",
        validate.display()
    );
    let files: Vec<PathBuf> = manifests(&manifest_dir())
        .expect("manifests")
        .into_iter()
        .map(|(path, _)| path)
        .collect();
    assert!(files.len() >= 10, "{files:?}");
    // A network namespace of its own, with no interface up: the schemas must be local.
    let output = Command::new("unshare")
        .arg("--net")
        .arg(&validate)
        .args(["--strict", "--quiet"])
        .args(&files)
        .output()
        .expect("run unshare (needs root)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}{stderr}");
    assert!(
        !stdout.contains("ERROR") && !stderr.contains("ERROR"),
        "{stdout}{stderr}"
    );
    // The kinds without a schema there are the Prometheus Operator's (PodMonitor,
    // PrometheusRule); the next test checks them.
    for line in stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| l.contains("WARN"))
    {
        assert!(
            ["kind PodMonitor ", "kind PrometheusRule "]
                .iter()
                .any(|kind| line.contains(kind)),
            "{line}"
        );
    }
}

/// `kubectl kustomize` renders the objects of every manifest, each unchanged: those of
/// `deploy/kubernetes` from its kustomization, those of `monitoring/` from its own; the
/// examples are in neither.
#[test]
fn kustomize_renders_every_manifest_offline() {
    let kubectl = venv_bin().join("kubectl");
    assert!(
        kubectl.exists(),
        "{} is missing: run scripts/test",
        kubectl.display()
    );
    let all = manifests(&manifest_dir()).expect("manifests");
    let key = |document: &Value| {
        (
            document["kind"].to_string(),
            document["metadata"]["name"].to_string(),
        )
    };
    for dir in [manifest_dir(), manifest_dir().join("monitoring")] {
        // A network namespace of its own, with no interface up: nothing is fetched.
        let output = Command::new("unshare")
            .arg("--net")
            .arg(&kubectl)
            .arg("kustomize")
            .arg(&dir)
            .output()
            .expect("run unshare (needs root)");
        assert!(
            output.status.success(),
            "{}: {}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        let mut rendered = yaml_documents(&output.stdout).expect("kustomize's output");
        let mut expected: Vec<Value> = all
            .iter()
            .filter(|(path, _)| path.parent() == Some(dir.as_path()))
            .flat_map(|(_, documents)| documents.iter().cloned())
            .collect();
        assert!(expected.len() >= 2, "{}", dir.display());
        rendered.sort_by_key(key);
        expected.sort_by_key(key);
        let names = |documents: &[Value]| documents.iter().map(key).collect::<Vec<_>>();
        assert_eq!(names(&rendered), names(&expected), "{}", dir.display());
        for (got, want) in rendered.iter().zip(&expected) {
            assert!(got == want, "{:?} differs in kustomize's output", key(want));
        }
    }
}

#[test]
fn kubernetes_manifests_agree() {
    let all = Manifests::load();
    let config = all.config();
    config.validate().expect("the ConfigMap's config is valid");
    let grace = config.mount.shutdown_grace;

    let ds = all.daemonset();
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    let spec = &ds["spec"]["template"]["spec"];
    let larder = container(spec, "larder");
    let args = args_of(larder);
    assert_eq!(args[0], "daemon");

    // The FUSE mount: under a hostPath mounted Bidirectional (so the node sees it) in a
    // privileged container (the API server refuses Bidirectional otherwise), one level below
    // the volume's root, so that pods mount its parent and see a remount.
    let (volume, host, below) = on_node(spec, larder, &config.mount.path);
    let host_parent = host.expect("the mount's volume is a hostPath");
    assert_eq!(below.components().count(), 1, "{below:?}");
    let host_mount = host_parent.join(&below);
    let mount = larder["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == volume.as_str())
        .unwrap();
    assert_eq!(mount["mountPropagation"], "Bidirectional");
    assert_eq!(larder["securityContext"]["privileged"], true);
    // The init container makes the mount point, on the same volume.
    let init = container(spec, "mountpoint");
    let command = init["command"].as_array().unwrap().last().map(str_of).unwrap();
    assert!(
        command.contains(&config.mount.path.display().to_string()),
        "{command}"
    );
    assert_eq!(
        on_node(spec, init, &config.mount.path).1,
        Some(host_parent.clone())
    );
    // No other container anywhere may propagate mounts to the node.
    for ((kind, name), document) in &all.0 {
        let text = document.to_string();
        let bidirectional = text.matches("\"Bidirectional\"").count();
        let expected = usize::from(kind == "DaemonSet");
        assert_eq!(bidirectional, expected, "{kind} {name}");
    }

    // /dev/fuse from the node, as a character device; the capability FUSE needs.
    let (_, fuse, _) = on_node(spec, larder, Path::new("/dev/fuse"));
    assert_eq!(fuse.as_deref(), Some(Path::new("/dev/fuse")));
    let fuse_volume = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["hostPath"]["path"] == "/dev/fuse")
        .unwrap();
    assert_eq!(fuse_volume["hostPath"]["type"], "CharDevice");
    let caps = larder["securityContext"]["capabilities"]["add"].to_string();
    assert!(caps.contains("SYS_ADMIN"), "{caps}");
    // Privileged, the node's network, hostPaths: the namespace must admit them whatever the
    // cluster's default Pod Security level.
    let namespace = all.get("Namespace", str_of(&ds["metadata"]["namespace"]));
    assert_eq!(
        namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "privileged"
    );
    // Evicted last, and replaced only by hand: a new pod breaks the files jobs hold open.
    assert_eq!(spec["priorityClassName"], "system-node-critical");
    assert_eq!(ds["spec"]["updateStrategy"]["type"], "OnDelete");
    // Where a cluster admits the critical classes only under a quota that names them, the
    // namespace has one.
    let quota = all.get("ResourceQuota", "larder-critical-pods");
    assert_eq!(quota["metadata"]["namespace"], ds["metadata"]["namespace"]);
    let scope = &quota["spec"]["scopeSelector"]["matchExpressions"][0];
    assert_eq!(scope["scopeName"], "PriorityClass");
    assert_eq!(scope["operator"], "In");
    assert!(
        scope["values"]
            .as_array()
            .unwrap()
            .contains(&spec["priorityClassName"]),
        "{scope}"
    );

    // The cache and the control socket live on the node; the cache on a directory that must
    // be there (made on the NVMe), never one the kubelet makes on the root disk.
    let volume_of = |name: &str| {
        spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap()
            .clone()
    };
    let (cache_volume, cache_host, _) = on_node(spec, larder, &config.cache.dir);
    assert!(cache_host.is_some(), "the cache dir is not a hostPath");
    assert_eq!(volume_of(&cache_volume)["hostPath"]["type"], "Directory");
    let (_, control_host, socket_below) = on_node(spec, larder, &config.control.socket);
    let host_socket = control_host
        .expect("the control socket's dir is a hostPath")
        .join(socket_below);

    // The node's network: the registry mirror on the node's loopback, where containerd (on
    // the node) reaches it and no pod or other node does, its port declared for the
    // scheduler; the metrics and peer listeners on the node's addresses, where the probes,
    // Prometheus and the other nodes reach them; the cluster's DNS for --peer-dns.
    assert_eq!(spec["hostNetwork"], true);
    assert_eq!(spec["dnsPolicy"], "ClusterFirstWithHostNet");
    let mirror = config.registry.listen.expect("the mirror listens");
    assert!(mirror.ip().is_loopback(), "{mirror}");
    assert!(config.registry.enabled(), "no upstream");
    assert_eq!(port_named(larder, "registry"), u64::from(mirror.port()));
    for listen in [config.metrics.listen, config.peer.listen] {
        assert!(listen.expect("listens").ip().is_unspecified(), "{listen:?}");
    }
    // containerd's hosts dir is the node's own, where the daemon writes the hosts.toml files.
    let hosts_dir = config
        .registry
        .containerd_hosts_dir
        .clone()
        .expect("the daemon keeps containerd's hosts files");
    let (_, hosts_host, hosts_below) = on_node(spec, larder, &hosts_dir);
    assert_eq!(hosts_host.map(|host| host.join(hosts_below)), Some(hosts_dir));

    // One image for every Larder container, by the digest of its index (amd64 and arm64).
    let ds_image = str_of(&larder["image"]);
    let (name, digest) = ds_image.split_once('@').expect("an image by digest");
    let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
    assert!(
        hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
        "{ds_image}"
    );
    let mut images = BTreeSet::new();
    let mut larder_containers = 0;
    for ((kind, _), document) in &all.0 {
        let pod_spec = match kind.as_str() {
            "DaemonSet" | "Job" => &document["spec"]["template"]["spec"],
            "Pod" => &document["spec"],
            _ => continue,
        };
        for list in ["containers", "initContainers"] {
            for c in pod_spec[list].as_array().into_iter().flatten() {
                let image = str_of(&c["image"]);
                if image.starts_with(name) {
                    larder_containers += 1;
                    images.insert(image.to_owned());
                }
            }
        }
    }
    assert_eq!(images, BTreeSet::from([ds_image.to_owned()]));
    assert_eq!(larder_containers, 4);

    // The config file is the ConfigMap's, the warm plan one of its keys, the key the Secret's.
    let configmap = all.get("ConfigMap", "larder-config");
    let file = PathBuf::from(flag(&args, "config"));
    let (config_volume, _, key) = on_node(spec, larder, &file);
    assert_eq!(volume_of(&config_volume)["configMap"]["name"], "larder-config");
    assert!(configmap["data"][key.to_str().unwrap()].is_string());
    let plan_path = config.warm.plan.clone().expect("a warm plan");
    let (plan_volume, _, plan_key) = on_node(spec, larder, &plan_path);
    assert_eq!(plan_volume, config_volume);
    let plan: Plan = toml::from_str(str_of(&configmap["data"][plan_key.to_str().unwrap()])).expect("plan");
    assert!(!plan.targets.is_empty());
    let key_file = PathBuf::from(flag(&args, "cluster-key-file"));
    let (key_volume, _, key_name) = on_node(spec, larder, &key_file);
    let key_volume = volume_of(&key_volume);
    let secret_name = str_of(&key_volume["secret"]["secretName"]);
    assert_eq!(key_volume["secret"]["defaultMode"], 0o400_u64);
    let secret = all.get("Secret", secret_name);
    assert!(secret["stringData"][key_name.to_str().unwrap()].is_string());
    let origin = larder["envFrom"][0]["secretRef"]["name"].as_str().unwrap();
    all.get("Secret", origin);

    // The node's name from the downward API is the node id (and the Node it patches).
    assert_eq!(flag(&args, "node-id"), "$(NODE_NAME)");
    let node_name = larder["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "NODE_NAME")
        .unwrap();
    assert_eq!(node_name["valueFrom"]["fieldRef"]["fieldPath"], "spec.nodeName");

    // Probes and scrapes on the metrics listener's port.
    let metrics_port = config.metrics.listen.expect("metrics on").port();
    assert_eq!(port_named(larder, "metrics"), u64::from(metrics_port));
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(larder[probe]["httpGet"]["path"], path);
        assert_eq!(larder[probe]["httpGet"]["port"], "metrics");
    }
    let monitor = all.get("PodMonitor", "larder");
    assert_eq!(monitor["spec"]["podMetricsEndpoints"][0]["port"], "metrics");
    assert_eq!(monitor["spec"]["podMetricsEndpoints"][0]["path"], "/metrics");
    let selects = |selector: &Value| selector.as_object().unwrap().iter().all(|(k, v)| labels[k] == *v);
    assert!(selects(&monitor["spec"]["selector"]["matchLabels"]));
    // Series are by node: the alerts and dashboards name an instance by its node.
    let relabel = &monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][0];
    assert_eq!(relabel["sourceLabels"][0], "__meta_kubernetes_pod_node_name");
    assert_eq!(relabel["targetLabel"], "instance");
    // The alerts: the PrometheusRule holds the rule file's groups (CI's promtool checks and
    // tests those).
    let rules = manifests(&manifest_dir().join("../prometheus")).expect("rules");
    let (_, documents) = rules
        .iter()
        .find(|(path, _)| path.ends_with("larder-rules.yaml"))
        .expect("deploy/prometheus/larder-rules.yaml");
    let rule = all.get("PrometheusRule", "larder");
    assert!(
        rule["spec"]["groups"] == documents[0]["groups"],
        "prometheusrule.yaml differs from deploy/prometheus/larder-rules.yaml: run deploy/kubernetes/generate-dashboard"
    );

    // Peers: the headless Service that --peer-dns names, with every pod in it, on the port
    // the peer listener binds.
    let service = all.get("Service", "larder-peers");
    assert_eq!(service["spec"]["clusterIP"], "None");
    assert_eq!(service["spec"]["publishNotReadyAddresses"], true);
    assert!(selects(&service["spec"]["selector"]));
    let service_port = service["spec"]["ports"][0]["port"].as_u64().unwrap();
    let namespace = str_of(&service["metadata"]["namespace"]);
    assert_eq!(
        flag(&args, "peer-dns"),
        format!("larder-peers.{namespace}.svc.cluster.local:{service_port}")
    );
    let peer_port = config.peer.listen.expect("peer listener on").port();
    assert_eq!(port_named(larder, "peer"), u64::from(peer_port));
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "peer");

    // SIGTERM has the grace period and a few seconds more before the kubelet kills.
    let period = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(period >= grace.as_secs() + 5, "{period}s for a {grace:?} grace");

    // RBAC: nodes, get and patch, nothing else; bound to the DaemonSet's account.
    let role = all.get("ClusterRole", "larder-node-labels");
    assert_eq!(
        role["rules"],
        serde_json::json!([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}])
    );
    let binding = all.get("ClusterRoleBinding", "larder-node-labels");
    assert_eq!(binding["subjects"][0]["name"], spec["serviceAccountName"]);
    all.get("ServiceAccount", str_of(&spec["serviceAccountName"]));

    // The example pod reads the mount through the parent's hostPath, HostToContainer,
    // read-only, unprivileged; its init container and the Job reach the daemon's socket.
    let pod = all.get("Pod", "llm-inference");
    let pod_spec = &pod["spec"];
    let workload = container(pod_spec, "inference");
    let reader = workload["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPropagation"].is_string())
        .expect("a propagated mount");
    assert_eq!(reader["mountPropagation"], "HostToContainer");
    assert_eq!(reader["readOnly"], true);
    let (_, pod_host, _) = on_node(pod_spec, workload, Path::new(str_of(&reader["mountPath"])));
    assert_eq!(pod_host.as_deref(), Some(host_parent.as_path()));
    assert!(workload["securityContext"]["privileged"].is_null());
    let script = str_of(&workload["args"][0]);
    let read = script
        .split('"')
        .find(|s| s.starts_with(str_of(&reader["mountPath"])))
        .expect("the path the workload reads");
    let (_, read_host, read_below) = on_node(pod_spec, workload, Path::new(read));
    assert!(read_host.unwrap().join(read_below).starts_with(&host_mount));
    let job = all.get("Job", "larder-prefetch");
    let job_spec = &job["spec"]["template"]["spec"];
    for (spec, name) in [(pod_spec, "prefetch"), (job_spec, "prefetch")] {
        let prefetch = container(spec, name);
        let args = args_of(prefetch);
        assert_eq!(args[..2], ["prefetch", "--wait"]);
        let socket = PathBuf::from(flag(&args, "socket"));
        let (_, host, below) = on_node(spec, prefetch, &socket);
        assert_eq!(host.expect("a hostPath").join(below), host_socket);
        assert!(prefetch["securityContext"]["privileged"].is_null());
        assert_eq!(prefetch["securityContext"]["capabilities"]["drop"][0], "ALL");
    }

    // The dashboard ConfigMap is the dashboard (deploy/kubernetes/generate-dashboard).
    let dashboard =
        std::fs::read_to_string(manifest_dir().join("../grafana/larder.json")).expect("dashboard");
    let configmap = all.get("ConfigMap", "larder-grafana-dashboard");
    assert!(
        configmap["data"]["larder.json"] == dashboard.as_str(),
        "50-grafana-dashboard.yaml differs from deploy/grafana/larder.json: run deploy/kubernetes/generate-dashboard"
    );
    assert_eq!(configmap["metadata"]["labels"]["grafana_dashboard"], "1");
}

/// A node and its pods, on this machine: every volume of a pod is a local directory, a hostPath
/// the same one for every pod that mounts it.
struct Node {
    root: PathBuf,
}

impl Node {
    /// The local path of container path `path` in the pod of `spec`; ConfigMap volumes are
    /// written out, Secret volumes get `secrets` (name → key → value) in their place.
    fn path(&self, spec: &Value, container: &Value, path: &Path) -> PathBuf {
        let (volume, host, below) = on_node(spec, container, path);
        match host {
            Some(host) => self
                .root
                .join("host")
                .join(host.strip_prefix("/").unwrap())
                .join(below),
            None => self.root.join("pod").join(volume).join(below),
        }
    }

    /// Rewrites every container path in `text` (the mount paths of `container`, longest first)
    /// to its local path.
    fn rewrite(&self, spec: &Value, container: &Value, text: &str) -> String {
        let mut mounts: Vec<&str> = container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| str_of(&m["mountPath"]))
            .filter(|m| *m != "/dev/fuse")
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        let mut out = text.to_owned();
        for mount in mounts {
            let local = self.path(spec, container, Path::new(mount)).display().to_string();
            // A path starts at a quote, an `=` or the start of an argument.
            for lead in ["\"", "=", " "] {
                out = out.replace(&format!("{lead}{mount}/"), &format!("{lead}{local}/"));
                out = out.replace(&format!("{lead}{mount}\""), &format!("{lead}{local}\""));
            }
            if out == mount || out.starts_with(&format!("{mount}/")) {
                out = format!("{local}{}", &out[mount.len()..]);
            }
        }
        out
    }
}

/// The daemon started as the DaemonSet says; killed, and its mount detached, when dropped.
struct Daemon {
    child: Child,
    mount: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if larder_tests::daemon::is_mounted(&self.mount) {
            let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        }
    }
}

fn free_port() -> u16 {
    larder_tests::free_port(std::net::Ipv4Addr::LOCALHOST).expect("port")
}

/// Runs `container` of the pod of `spec` as written (its args, after `larder`), paths local.
fn run_larder(node: &Node, spec: &Value, container: &Value) -> std::process::Output {
    let args: Vec<String> = args_of(container)
        .iter()
        .map(|a| node.rewrite(spec, container, a))
        .collect();
    Command::new(BIN)
        .args(&args)
        .env_remove("LARDER_CONTROL_SOCKET")
        .output()
        .expect("run larder")
}

/// The daemon's command as the DaemonSet gives it, made local: its arguments and environment.
struct Launch {
    args: Vec<String>,
    env: HashMap<String, String>,
    /// The mount point, on this machine.
    mount: PathBuf,
    /// The metrics listener's address (the probes' port).
    metrics: String,
}

impl Launch {
    /// Starts the daemon with its log in `log`, and waits until the readiness probe's path
    /// answers 200 on the metrics listener and the mount is up.
    async fn start(&self, log: &Path, readiness: &Value) -> Daemon {
        let child = Command::new(BIN)
            .args(&self.args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .envs(&self.env)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("start the daemon");
        let mut daemon = Daemon {
            child,
            mount: self.mount.clone(),
        };
        let readyz = format!("http://{}{}", self.metrics, str_of(&readiness["httpGet"]["path"]));
        let started = Instant::now();
        loop {
            if let Ok(response) = reqwest::get(&readyz).await
                && response.status() == 200
            {
                break;
            }
            if let Some(status) = daemon.child.try_wait().unwrap() {
                panic!(
                    "the daemon exited with {status}:\n{}",
                    std::fs::read_to_string(log).unwrap()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "not ready in 30s:\n{}",
                std::fs::read_to_string(log).unwrap()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            larder_tests::daemon::is_mounted(&self.mount),
            "{}",
            self.mount.display()
        );
        daemon
    }

    /// The value of `series` on the daemon's `/metrics`; 0 if absent.
    async fn metric(&self, series: &str) -> f64 {
        let body = reqwest::get(format!("http://{}/metrics", self.metrics))
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics");
        body.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .map_or(0.0, |v| v.parse().expect("number"))
    }
}

/// SIGTERM, as the kubelet stops the pod (a restart, an upgrade, an uninstall): the daemon
/// exits 0 within the grace period, its mount gone.
async fn stop(mut daemon: Daemon, grace: Duration, log: &Path) {
    // SAFETY: signals our own child by its pid.
    assert_eq!(unsafe { libc::kill(daemon.child.id() as i32, libc::SIGTERM) }, 0);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = daemon.child.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < grace, "not stopped within the grace period");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        status.success(),
        "{status}:\n{}",
        std::fs::read_to_string(log).unwrap()
    );
    assert!(!larder_tests::daemon::is_mounted(&daemon.mount));
}

/// Pulls `reference` for linux/amd64 with `containerd`, using the hosts dir `hosts`, and checks
/// that containerd holds the image by every digest of it.
fn pull_through(containerd: &Containerd, hosts: &Path, reference: &str, image: &TestImage) {
    let pull = containerd
        .pull(reference, Some(hosts), Some("linux/amd64"))
        .expect("ctr");
    assert!(
        pull.status.success(),
        "pull: {}; containerd: {}",
        String::from_utf8_lossy(&pull.stderr),
        containerd.log_tail(10)
    );
    assert_eq!(
        containerd.image_digest(reference).expect("image"),
        image.index.digest
    );
    assert_eq!(
        containerd.content_digests().expect("content"),
        image.pulled("linux/amd64").expect("platform")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_daemonset_runs_as_written_against_seaweedfs() {
    let weed = Seaweed::installed_binary();
    assert!(weed.exists(), "{} is missing: run scripts/test", weed.display());
    let seaweed = tokio::task::spawn_blocking(move || Seaweed::start(&weed, "models"))
        .await
        .expect("join")
        .expect("weed mini");
    let objects = [
        ("base/llama-mini/model.safetensors", 9 * MIB + 3),
        ("base/llama-mini/config.json", 700),
        ("base/other/weights.bin", 2 * MIB),
    ];
    let client = seaweed.client().expect("client");
    for (key, size) in objects {
        upload(client.as_ref(), key, seed(key, 0), size)
            .await
            .expect("upload");
    }
    let api = ApiServer::start().await.expect("api server");
    // The registry the ConfigMap's placeholder upstream stands for: an image in a real
    // registry, behind a proxy that counts the blob bytes it sends.
    let (registry, image) = tokio::task::spawn_blocking(|| {
        let image = TestImage::write(21, 8 * MIB)?;
        let registry = Registry::start()?;
        push(image.path(), registry.address(), "larder/test:v1", None)?;
        anyhow::Ok((registry, image))
    })
    .await
    .expect("join")
    .expect("a registry holding the test image");
    let proxy = RecordingProxy::start_to(registry.address()).await.expect("proxy");

    let all = Manifests::load();
    let config = all.config();
    let ds = all.daemonset();
    let spec = &ds["spec"]["template"]["spec"];
    let larder = container(spec, "larder");
    let dir = tempfile::tempdir().expect("tempdir");
    let node = Node {
        root: dir.path().to_owned(),
    };

    // The volumes: hostPath directories, made as the kubelet makes those of type
    // DirectoryOrCreate and as the operator makes those of type Directory before installing
    // (the cache's, on the NVMe); the ConfigMap's files; the Secrets with values that work here
    // (the manifests hold placeholders).
    for volume in spec["volumes"].as_array().unwrap() {
        if let Some(host) = volume["hostPath"]["path"].as_str()
            && matches!(
                volume["hostPath"]["type"].as_str(),
                Some("DirectoryOrCreate" | "Directory")
            )
        {
            std::fs::create_dir_all(node.root.join("host").join(&host[1..])).expect("hostPath");
        }
    }
    let metrics = format!("127.0.0.1:{}", free_port());
    let peer_port = free_port();
    let mirror = format!("127.0.0.1:{}", free_port());
    let upstream = &config.registry.upstreams[0].host;
    for volume in spec["volumes"].as_array().unwrap() {
        let local = node.root.join("pod").join(str_of(&volume["name"]));
        if let Some(name) = volume["configMap"]["name"].as_str() {
            std::fs::create_dir_all(&local).unwrap();
            for (key, value) in all.get("ConfigMap", name)["data"].as_object().unwrap() {
                let mut text = node.rewrite(spec, larder, str_of(value));
                if key == "larder.toml" {
                    // What must be local: the bucket, the registry's address and the listen
                    // addresses.
                    let replaced = [
                        (
                            r#"url = "s3://REPLACE-WITH-YOUR-BUCKET/models""#.to_owned(),
                            format!("url = \"{}\"", seaweed.url()),
                        ),
                        (
                            format!("upstreams = [\"{upstream}\"]"),
                            format!("upstreams = [\"{upstream}={}\"]", proxy.endpoint()),
                        ),
                        ("\"0.0.0.0:9464\"".to_owned(), format!("\"{metrics}\"")),
                        (
                            "\"0.0.0.0:7470\"".to_owned(),
                            format!("\"127.0.0.1:{peer_port}\""),
                        ),
                        ("\"127.0.0.1:7471\"".to_owned(), format!("\"{mirror}\"")),
                    ];
                    for (from, to) in replaced {
                        assert!(text.contains(&from), "no {from} in:\n{text}");
                        text = text.replace(&from, &to);
                    }
                }
                std::fs::write(local.join(key), text).unwrap();
            }
        }
        if volume["secret"].is_object() {
            std::fs::create_dir_all(&local).unwrap();
            let key = local.join("cluster.key");
            std::fs::write(&key, "0123456789abcdef0123456789abcdef0123456789abcdef\n").unwrap();
            let mode = volume["secret"]["defaultMode"].as_u64().unwrap() as u32;
            std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode)).unwrap();
        }
    }
    // containerd's hosts dir on the node, with a file of the operator's for another registry.
    let hosts_dir = config
        .registry
        .containerd_hosts_dir
        .clone()
        .expect("containerd's hosts dir");
    let hosts = node.path(spec, larder, &hosts_dir);
    let theirs = hosts.join("quay.io/hosts.toml");
    let their_text = "server = \"https://quay.io\"\n";
    std::fs::create_dir_all(theirs.parent().unwrap()).unwrap();
    std::fs::write(&theirs, their_text).unwrap();
    // The init container makes the mount point.
    let init = container(spec, "mountpoint");
    let command: Vec<String> = init["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| node.rewrite(spec, init, str_of(c)))
        .collect();
    assert!(
        Command::new(&command[0])
            .args(&command[1..])
            .status()
            .unwrap()
            .success()
    );

    // The environment: the downward API's node name, the container's own values, the origin
    // Secret's keys with SeaweedFS' values, and what reaches a local S3 server and API server.
    let mut env: HashMap<String, String> = HashMap::new();
    for variable in larder["env"].as_array().unwrap() {
        let value = match variable["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
            Some("spec.nodeName") => "gpu-node-1".to_owned(),
            Some(other) => panic!("no stand-in for {other}"),
            None => str_of(&variable["value"]).to_owned(),
        };
        env.insert(str_of(&variable["name"]).to_owned(), value);
    }
    let origin = all.get("Secret", str_of(&larder["envFrom"][0]["secretRef"]["name"]));
    for (key, value) in origin["stringData"].as_object().unwrap() {
        let local = match key.as_str() {
            "AWS_ACCESS_KEY_ID" => larder_tests::ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY" => larder_tests::SECRET_KEY,
            _ => str_of(value),
        };
        env.insert(key.clone(), local.to_owned());
    }
    let token = node.root.join("token");
    std::fs::write(&token, "token").unwrap();
    env.extend([
        ("AWS_ENDPOINT_URL".to_owned(), seaweed.endpoint.clone()),
        ("AWS_ALLOW_HTTP".to_owned(), "true".to_owned()),
        ("LARDER_WARM_API_SERVER".to_owned(), api.url()),
        ("LARDER_WARM_TOKEN_FILE".to_owned(), token.display().to_string()),
        // The cache lives on this machine's disk, whose free space is not the manifest's.
        ("LARDER_MIN_FREE_FRACTION".to_owned(), "0".to_owned()),
    ]);
    // The args, with $(VAR) expanded from the container's environment as the kubelet does.
    let args: Vec<String> = args_of(larder)
        .iter()
        .map(|arg| {
            let mut arg = node.rewrite(spec, larder, arg);
            for (name, value) in &env {
                arg = arg.replace(&format!("$({name})"), value);
            }
            // The Service's DNS name, as this machine can resolve it.
            if let Some(dns) = arg.strip_prefix("--peer-dns=") {
                assert!(dns.starts_with("larder-peers."), "{dns}");
                arg = format!("--peer-dns=localhost:{peer_port}");
            }
            arg
        })
        .collect();
    assert!(args.contains(&"--node-id=gpu-node-1".to_owned()), "{args:?}");
    let mount = node.path(spec, larder, &config.mount.path);
    let launch = Launch {
        args,
        env,
        mount: mount.clone(),
        metrics,
    };
    let readiness = &larder["readinessProbe"];
    assert_eq!(readiness["httpGet"]["port"], "metrics");
    let log = node.root.join("daemon.log");
    let daemon = launch.start(&log, readiness).await;

    // The prefetch Job, as written, against this node's control socket.
    let job = all.get("Job", "larder-prefetch");
    let job_spec = &job["spec"]["template"]["spec"];
    let output = tokio::task::block_in_place(|| run_larder(&node, job_spec, container(job_spec, "prefetch")));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    // The example pod: its init container prefetches, its workload reads through the hostPath.
    let pod = all.get("Pod", "llm-inference");
    let pod_spec = &pod["spec"];
    let output = tokio::task::block_in_place(|| run_larder(&node, pod_spec, container(pod_spec, "prefetch")));
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let workload = container(pod_spec, "inference");
    let script = str_of(&workload["args"][0]);
    let read = script.split('"').find(|s| s.starts_with('/')).expect("a path");
    let local = node.path(pod_spec, workload, Path::new(read));
    let (key, size) = objects[0];
    let bytes = tokio::task::block_in_place(|| std::fs::read(&local)).expect("read through the mount");
    assert!(
        bytes == content(seed(key, 0), 0, size as usize),
        "wrong bytes at {}",
        local.display()
    );

    // Every byte came from SeaweedFS once; the prefetches made it all cached.
    let status = tokio::task::block_in_place(|| {
        let socket = node.path(spec, larder, &config.control.socket);
        let output = Command::new(BIN)
            .args(["status", "--json", "--socket"])
            .arg(&socket)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice::<Value>(&output.stdout).unwrap()
    });
    let total: u64 = objects.iter().map(|(_, size)| size).sum();
    assert!(status["used_bytes"].as_u64().unwrap() >= total, "{status:#}");
    assert_eq!(status["settings"]["mount"], mount.display().to_string());

    // The warm plan of the ConfigMap labels this node.
    let label = format!("larder.dev/warm-{}", config.warm.plan_name().unwrap());
    let patches = api
        .wait_for(Duration::from_secs(30), |p| {
            p.last().and_then(|p| p.label(&label)) == Some(Some("true".into()))
        })
        .await
        .expect("the node is labelled warm");
    assert_eq!(patches[0].path, "/api/v1/nodes/gpu-node-1");

    // Images: the daemon wrote the upstream's hosts.toml into containerd's hosts dir, pointing
    // at its mirror, and left the operator's file alone.
    let ours = hosts.join(upstream).join("hosts.toml");
    let written = std::fs::read_to_string(&ours).expect("the upstream's hosts.toml");
    assert!(
        written.starts_with("# Written by Larder")
            && written.contains(&format!("[host.\"http://{mirror}\"]"))
            && written.contains(&format!("server = \"{}\"", proxy.endpoint())),
        "{written}"
    );
    assert_eq!(std::fs::read_to_string(&theirs).unwrap(), their_text);
    // A real containerd, reading that hosts dir, pulls the image through the mirror: the
    // upstream sends each blob once, the mirror sends them all to containerd.
    let containerd = tokio::task::block_in_place(Containerd::start).expect("containerd");
    let reference = format!("{upstream}/larder/test:v1");
    tokio::task::block_in_place(|| pull_through(&containerd, &hosts, &reference, &image));
    let amd64 = image.image("linux/amd64").expect("amd64");
    let wanted = amd64.layer_bytes() + amd64.config.size;
    let cold = proxy.body_bytes_of(is_blob_get);
    assert!(
        cold >= wanted && cold as f64 <= 1.05 * wanted as f64,
        "the upstream sent {cold} blob bytes for {wanted}"
    );
    let sent = launch.metric("larder_registry_sent_bytes_total").await;
    assert!(sent >= wanted as f64, "the mirror sent {sent} bytes for {wanted}");

    // SIGTERM: the daemon stops, and takes its hosts.toml (and the directory it made) with it.
    let grace = Duration::from_secs(spec["terminationGracePeriodSeconds"].as_u64().unwrap());
    stop(daemon, grace, &log).await;
    assert!(!ours.parent().unwrap().exists(), "{} is left", ours.display());
    assert_eq!(std::fs::read_to_string(&theirs).unwrap(), their_text);

    // Started again on the same node: the file is back, and a pull of the image, gone from
    // containerd, costs the upstream no blob byte.
    let log = node.root.join("daemon-again.log");
    let daemon = launch.start(&log, readiness).await;
    assert_eq!(std::fs::read_to_string(&ours).expect("hosts.toml again"), written);
    tokio::task::block_in_place(|| {
        containerd.remove_all().expect("reset containerd");
        pull_through(&containerd, &hosts, &reference, &image);
    });
    assert_eq!(
        proxy.body_bytes_of(is_blob_get),
        cold,
        "a warm pull fetched blobs upstream"
    );

    // Uninstalled (the pod deleted: SIGTERM): nothing of Larder's is left in containerd's hosts
    // dir, and the operator's file is as it was.
    stop(daemon, grace, &log).await;
    let left: Vec<PathBuf> = std::fs::read_dir(&hosts)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    assert_eq!(left, [theirs.parent().unwrap()]);
    assert_eq!(std::fs::read_to_string(&theirs).unwrap(), their_text);
}
