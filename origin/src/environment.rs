//! Where an origin's endpoint and credentials come from: the environment variables and files
//! each cloud's own tools read, so a node set up for `aws`, `gcloud` or `az` is set up for
//! Larder. A variable wins over a file, as it does for those tools.
//!
//! - **S3**: `AWS_*` variables (object_store's names: `AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL`, ...). Where
//!   no access key is set, the AWS CLI's shared files: the profile `AWS_PROFILE` (else
//!   `default`) of `~/.aws/credentials` (`AWS_SHARED_CREDENTIALS_FILE`) for the keys and of
//!   `~/.aws/config` (`AWS_CONFIG_FILE`) for `region` and `endpoint_url` (an `http://` endpoint
//!   there is allowed as written). A profile that is named but in neither file is an error, as
//!   it is for the CLI.
//! - **GCS**: `GOOGLE_*` variables; `STORAGE_EMULATOR_HOST`, the name Google's client libraries
//!   give an emulator's address (requests go there, unsigned, and no credentials are looked
//!   for); and where no credentials are
//!   named, gcloud's application default credentials
//!   (`~/.config/gcloud/application_default_credentials.json`).
//! - **Azure**: `AZURE_*` variables, over `AZURE_STORAGE_CONNECTION_STRING`, the connection
//!   string of the Azure CLI and SDKs (`AccountName`, `AccountKey`, `SharedAccessSignature`,
//!   `BlobEndpoint` or `DefaultEndpointsProtocol` with `EndpointSuffix`, and
//!   `UseDevelopmentStorage=true`).
//!
//! An environment is a value, not the process's: tests hand each origin the one they mean.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// Words in a setting's name that make its value a secret, hidden wherever Larder prints it
/// (keys, tokens, signatures: some are sent with requests, which a server may echo).
const SECRET_WORDS: &[&str] = &[
    "key",
    "token",
    "secret",
    "sas",
    "password",
    "signature",
    "credential",
];

/// Environment variables, the process's or a test's.
#[derive(Debug, Clone, Default)]
pub struct Environment {
    vars: BTreeMap<String, String>,
}

/// The clouds whose settings an environment gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cloud {
    S3,
    Gcs,
    Azure,
}

/// One setting for object_store's builder of a cloud: a config key's name (as object_store
/// parses it) and its value. Later settings override earlier ones.
pub type Setting = (String, String);

impl Environment {
    /// The process's variables (those that are UTF-8).
    pub fn process() -> Self {
        std::env::vars_os()
            .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
            .collect()
    }

    /// A variable's value, if it is set and not empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.vars
            .get(name)
            .map(String::as_str)
            .filter(|value| !value.is_empty())
    }

    /// A file under the home directory.
    fn home_file(&self, relative: &str) -> Option<PathBuf> {
        self.get("HOME").map(|home| PathBuf::from(home).join(relative))
    }

    /// The settings `cloud`'s builder takes from here, lowest priority first; an error names a
    /// setting that cannot be used.
    pub fn settings(&self, cloud: Cloud) -> Result<Vec<Setting>, String> {
        let mut settings = match cloud {
            Cloud::S3 => self.aws_files()?,
            Cloud::Gcs => self.gcloud(),
            Cloud::Azure => self.azure_connection_string()?,
        };
        let prefix = match cloud {
            Cloud::S3 => "AWS_",
            Cloud::Gcs => "GOOGLE_",
            Cloud::Azure => "AZURE_",
        };
        settings.extend(
            self.vars
                .iter()
                .filter(|(name, value)| name.starts_with(prefix) && !value.is_empty())
                .map(|(name, value)| (name.to_ascii_lowercase(), value.clone())),
        );
        for (name, value) in &settings {
            if SECRET_WORDS.iter().any(|word| name.contains(word)) {
                larder_config::hide_secret(value);
            }
        }
        Ok(settings)
    }

    /// What the AWS CLI's shared files give, for what no variable sets.
    fn aws_files(&self) -> Result<Vec<Setting>, String> {
        let named = self.get("AWS_PROFILE");
        let profile = named.unwrap_or("default");
        let path = |variable: &str, relative: &str| {
            self.get(variable)
                .map(PathBuf::from)
                .or_else(|| self.home_file(relative))
        };
        let read = |path: Option<PathBuf>, section: &str| -> Result<Option<Ini>, String> {
            let Some(path) = path else { return Ok(None) };
            match std::fs::read_to_string(&path) {
                Ok(text) => Ok(ini_section(&text, section)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(format!("cannot read {}: {e}", path.display())),
            }
        };
        let credentials = read(path("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"), profile)?;
        let config_section = match profile {
            "default" => "default".to_owned(),
            other => format!("profile {other}"),
        };
        let config = read(path("AWS_CONFIG_FILE", ".aws/config"), &config_section)?;
        if let Some(named) = named
            && credentials.is_none()
            && config.is_none()
        {
            return Err(format!(
                "AWS_PROFILE names the profile {named:?}, which neither the shared credentials nor the config file has"
            ));
        }
        let mut settings = Vec::new();
        let mut take = |section: &Option<Ini>, names: &[(&str, &str)]| {
            for (file_key, setting) in names {
                if let Some(value) = section.as_ref().and_then(|s| s.get(*file_key)) {
                    settings.push(((*setting).to_owned(), value.clone()));
                }
            }
        };
        take(
            &config,
            &[("region", "aws_region"), ("endpoint_url", "aws_endpoint_url")],
        );
        // Keys come from one place as a whole: a session token of a file never goes with a
        // variable's key.
        if self.get("AWS_ACCESS_KEY_ID").is_none() {
            let keys = [
                ("aws_access_key_id", "aws_access_key_id"),
                ("aws_secret_access_key", "aws_secret_access_key"),
                ("aws_session_token", "aws_session_token"),
            ];
            take(&credentials, &keys);
            take(&config, &keys);
        }
        // The files have no key for it: an endpoint written with http:// is meant as it is.
        if let Some(endpoint) = config.as_ref().and_then(|c| c.get("endpoint_url"))
            && endpoint.starts_with("http://")
        {
            settings.push(("aws_allow_http".to_owned(), "true".to_owned()));
        }
        Ok(settings)
    }

    /// An emulator named the way Google's libraries name it, and gcloud's default credentials.
    fn gcloud(&self) -> Vec<Setting> {
        let mut settings = Vec::new();
        if let Some(host) = self.get("STORAGE_EMULATOR_HOST") {
            let url = if host.contains("://") {
                host.to_owned()
            } else {
                format!("http://{host}")
            };
            // Nothing is signed, and no credentials are looked for: object_store's writes ask
            // for a token even when told to sign nothing, which a key that disables OAuth
            // gives without leaving the node.
            let key = format!(
                r#"{{"gcs_base_url":"{url}","disable_oauth":true,"client_email":"","private_key":"","private_key_id":""}}"#
            );
            settings.push(("google_service_account_key".to_owned(), key));
            settings.push(("google_base_url".to_owned(), url));
            settings.push(("google_skip_signature".to_owned(), "true".to_owned()));
        }
        let named = [
            "GOOGLE_APPLICATION_CREDENTIALS",
            "GOOGLE_SERVICE_ACCOUNT",
            "GOOGLE_SERVICE_ACCOUNT_PATH",
            "GOOGLE_SERVICE_ACCOUNT_KEY",
        ]
        .iter()
        .any(|name| self.get(name).is_some());
        if !named
            && let Some(file) = self
                .home_file(".config/gcloud/application_default_credentials.json")
                .filter(|file| file.is_file())
        {
            settings.push((
                "google_application_credentials".to_owned(),
                file.display().to_string(),
            ));
        }
        settings
    }

    /// What an Azure connection string gives.
    fn azure_connection_string(&self) -> Result<Vec<Setting>, String> {
        let Some(text) = self.get("AZURE_STORAGE_CONNECTION_STRING") else {
            return Ok(Vec::new());
        };
        let mut fields = BTreeMap::new();
        for field in text.split(';').map(str::trim).filter(|f| !f.is_empty()) {
            let (name, value) = field.split_once('=').ok_or_else(|| {
                format!(
                    "AZURE_STORAGE_CONNECTION_STRING: {name:?} is not Name=value",
                    name = field.split('=').next().unwrap_or_default()
                )
            })?;
            fields.insert(name.to_ascii_lowercase(), value.to_owned());
        }
        let field = |name: &str| fields.get(name).map(String::as_str);
        let mut settings = Vec::new();
        if field("usedevelopmentstorage") == Some("true") {
            settings.push(("azure_storage_use_emulator".to_owned(), "true".to_owned()));
        }
        for (name, setting) in [
            ("accountname", "azure_storage_account_name"),
            ("accountkey", "azure_storage_account_key"),
            ("sharedaccesssignature", "azure_storage_sas_key"),
        ] {
            if let Some(value) = field(name) {
                settings.push((setting.to_owned(), value.to_owned()));
            }
        }
        let protocol = field("defaultendpointsprotocol").unwrap_or("https");
        let endpoint = match (
            field("blobendpoint"),
            field("accountname"),
            field("endpointsuffix"),
        ) {
            (Some(endpoint), _, _) => Some(endpoint.to_owned()),
            (None, Some(account), Some(suffix)) => Some(format!("{protocol}://{account}.blob.{suffix}")),
            _ => None,
        };
        if let Some(endpoint) = endpoint {
            if endpoint.starts_with("http://") {
                settings.push(("azure_allow_http".to_owned(), "true".to_owned()));
            }
            settings.push(("azure_storage_endpoint".to_owned(), endpoint));
        }
        Ok(settings)
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Environment {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Self {
        Self {
            vars: pairs
                .into_iter()
                .map(|(name, value)| (name.into(), value.into()))
                .collect(),
        }
    }
}

/// One section of an INI file: its keys (lowercased) and values.
type Ini = BTreeMap<String, String>;

/// The section `[name]` of an INI file as the AWS CLI writes them (`key = value`, `#` and `;`
/// comments), if it has one.
fn ini_section(text: &str, name: &str) -> Option<Ini> {
    let mut found = None;
    let mut current = false;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(section) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = section.trim() == name;
            if current {
                found.get_or_insert_with(Ini::new);
            }
            continue;
        }
        if current
            && let Some((key, value)) = line.split_once('=')
            && let Some(section) = found.as_mut()
        {
            section.insert(key.trim().to_ascii_lowercase(), value.trim().to_owned());
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(env: &[(&str, &str)], cloud: Cloud) -> Vec<Setting> {
        env.iter()
            .copied()
            .collect::<Environment>()
            .settings(cloud)
            .expect("settings")
    }

    fn pairs(settings: &[(&str, &str)]) -> Vec<Setting> {
        settings
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn aws_profiles_come_from_the_shared_files_and_variables_win() {
        let home = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(home.path().join(".aws")).expect("mkdir");
        std::fs::write(
            home.path().join(".aws/credentials"),
            "# keys\n[default]\naws_access_key_id = AKDEFAULT\naws_secret_access_key = s1\n\n[gpu]\naws_access_key_id=AKGPU\naws_secret_access_key=s2\naws_session_token = t2\n",
        )
        .expect("write");
        std::fs::write(
            home.path().join(".aws/config"),
            "[default]\nregion = eu-west-1\n[profile gpu]\nregion = us-east-2\nendpoint_url = http://127.0.0.1:9000\n",
        )
        .expect("write");
        let home = home.path().to_str().expect("utf-8");
        assert_eq!(
            settings(&[("HOME", home)], Cloud::S3),
            pairs(&[
                ("aws_region", "eu-west-1"),
                ("aws_access_key_id", "AKDEFAULT"),
                ("aws_secret_access_key", "s1"),
            ])
        );
        assert_eq!(
            settings(&[("HOME", home), ("AWS_PROFILE", "gpu")], Cloud::S3),
            pairs(&[
                ("aws_region", "us-east-2"),
                ("aws_endpoint_url", "http://127.0.0.1:9000"),
                ("aws_access_key_id", "AKGPU"),
                ("aws_secret_access_key", "s2"),
                ("aws_session_token", "t2"),
                ("aws_allow_http", "true"),
                ("aws_profile", "gpu"),
            ])
        );
        // A key in a variable takes none of the file's keys; the variables come last (win).
        assert_eq!(
            settings(
                &[
                    ("HOME", home),
                    ("AWS_ACCESS_KEY_ID", "AKENV"),
                    ("AWS_REGION", "ap-south-1")
                ],
                Cloud::S3
            ),
            pairs(&[
                ("aws_region", "eu-west-1"),
                ("aws_access_key_id", "AKENV"),
                ("aws_region", "ap-south-1"),
            ])
        );
        let missing = [("HOME", home), ("AWS_PROFILE", "nope")]
            .into_iter()
            .collect::<Environment>()
            .settings(Cloud::S3)
            .expect_err("an unknown profile");
        assert!(missing.contains("\"nope\""), "{missing}");
    }

    #[test]
    fn google_emulators_and_default_credentials() {
        assert_eq!(
            settings(&[("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")], Cloud::Gcs),
            pairs(&[
                (
                    "google_service_account_key",
                    r#"{"gcs_base_url":"http://127.0.0.1:4443","disable_oauth":true,"client_email":"","private_key":"","private_key_id":""}"#
                ),
                ("google_base_url", "http://127.0.0.1:4443"),
                ("google_skip_signature", "true"),
            ])
        );
        let home = tempfile::tempdir().expect("tempdir");
        let adc = home
            .path()
            .join(".config/gcloud/application_default_credentials.json");
        std::fs::create_dir_all(adc.parent().expect("parent")).expect("mkdir");
        std::fs::write(&adc, "{}").expect("write");
        let home = home.path().to_str().expect("utf-8");
        assert_eq!(
            settings(&[("HOME", home)], Cloud::Gcs),
            pairs(&[("google_application_credentials", adc.to_str().expect("utf-8"))])
        );
        assert_eq!(
            settings(
                &[("HOME", home), ("GOOGLE_APPLICATION_CREDENTIALS", "/k.json")],
                Cloud::Gcs
            ),
            pairs(&[("google_application_credentials", "/k.json")])
        );
    }

    #[test]
    fn azure_connection_strings() {
        assert_eq!(
            settings(
                &[(
                    "AZURE_STORAGE_CONNECTION_STRING",
                    "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5==;BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;"
                )],
                Cloud::Azure
            )[..4],
            pairs(&[
                ("azure_storage_account_name", "devstoreaccount1"),
                ("azure_storage_account_key", "a2V5=="),
                ("azure_allow_http", "true"),
                (
                    "azure_storage_endpoint",
                    "http://127.0.0.1:10000/devstoreaccount1"
                ),
            ])[..]
        );
        assert_eq!(
            settings(
                &[
                    (
                        "AZURE_STORAGE_CONNECTION_STRING",
                        "AccountName=gpu;AccountKey=k;EndpointSuffix=core.windows.net"
                    ),
                    ("AZURE_STORAGE_ACCOUNT_KEY", "other")
                ],
                Cloud::Azure
            ),
            pairs(&[
                ("azure_storage_account_name", "gpu"),
                ("azure_storage_account_key", "k"),
                ("azure_storage_endpoint", "https://gpu.blob.core.windows.net"),
                ("azure_storage_account_key", "other"),
                (
                    "azure_storage_connection_string",
                    "AccountName=gpu;AccountKey=k;EndpointSuffix=core.windows.net"
                ),
            ])
        );
        let bad = [("AZURE_STORAGE_CONNECTION_STRING", "AccountName")]
            .into_iter()
            .collect::<Environment>()
            .settings(Cloud::Azure)
            .expect_err("no value");
        assert!(bad.contains("AccountName"), "{bad}");
    }
}
