//! Building an origin from a source's URL: the store for its scheme (a local directory, S3,
//! GCS, Azure, HTTP) with the environment's settings and Larder's client settings, its paged
//! listings and the checksums the store publishes.

use std::sync::{Arc, Once};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use larder_config::{OriginConfig, Redacted, SourceConfig};
use larder_stats::OriginStats;
use object_store::list::PaginatedListStore;
use object_store::path::Path;
use object_store::{
    BackoffConfig, ClientConfigKey, ClientOptions, ObjectStore, ObjectStoreScheme, RetryConfig,
};

use crate::checksums::{Convention, PublishedChecksums, Urls};
use crate::environment::{self, Cloud, Environment};
use crate::{Origin, OriginError};

/// Installs the process-wide TLS crypto provider once (the `ring` backend).
fn install_crypto_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // An error means another provider was installed first, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl Origin {
    /// Builds the origin for a configured source. Endpoints, regions and credentials come from
    /// `env`, as each cloud's own tools take them (see [`environment`]).
    pub fn from_config(
        source: &SourceConfig,
        config: &OriginConfig,
        stats: Arc<OriginStats>,
        env: &Environment,
    ) -> Result<Self, OriginError> {
        install_crypto_provider();
        // object_store's messages may quote the URL: its secrets are hidden there too.
        let config_error = |message: String| OriginError::Config {
            source_name: source.name.clone(),
            url: source.url.clone(),
            message: Redacted(&message).to_string(),
        };
        let url =
            url::Url::parse(source.url.as_str()).map_err(|e| config_error(format!("not a URL: {e}")))?;
        let (scheme, prefix) = ObjectStoreScheme::parse(&url).map_err(|e| config_error(e.to_string()))?;
        // Larder bounds attempts itself; the client's own timeout only backs it up.
        let client = [
            (
                ClientConfigKey::ConnectTimeout,
                humantime::format_duration(config.connect_timeout).to_string(),
            ),
            (
                ClientConfigKey::Timeout,
                humantime::format_duration(config.read_deadline).to_string(),
            ),
        ];
        // A cloud's builder with what the environment sets (names it does not know are
        // ignored, as object_store's own `from_env` does) and the client settings above.
        fn configured<B, K: std::str::FromStr>(
            builder: B,
            settings: Vec<environment::Setting>,
            client: &[(ClientConfigKey, String)],
            set: fn(B, K, String) -> B,
            client_key: fn(ClientConfigKey) -> K,
        ) -> B {
            let builder = settings
                .into_iter()
                .fold(builder, |b, (name, value)| match name.parse() {
                    Ok(key) => set(b, key, value),
                    Err(_) => b,
                });
            client
                .iter()
                .fold(builder, |b, (key, value)| set(b, client_key(*key), value.clone()))
        }
        let settings = |cloud| env.settings(cloud).map_err(&config_error);
        // Larder retries itself, under its budget; the store must not multiply attempts.
        let no_retries = RetryConfig {
            backoff: BackoffConfig::default(),
            max_retries: 0,
            retry_timeout: config.read_deadline,
        };
        // The cloud stores also page their listings.
        fn paged<S: ObjectStore + PaginatedListStore>(
            store: Arc<S>,
        ) -> (Arc<dyn ObjectStore>, Option<Arc<dyn PaginatedListStore>>) {
            (store.clone(), Some(store))
        }
        let mut published = None;
        let (store, pager) = match scheme {
            ObjectStoreScheme::Local => {
                let root = url
                    .to_file_path()
                    .map_err(|()| config_error("not a local path".into()))?;
                let store: Arc<dyn ObjectStore> = Arc::new(
                    object_store::local::LocalFileSystem::new_with_prefix(&root)
                        .map_err(|e| config_error(e.to_string()))?,
                );
                (store, None)
            }
            ObjectStoreScheme::AmazonS3 => {
                use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
                let s3 = Arc::new(
                    configured(
                        AmazonS3Builder::new(),
                        settings(Cloud::S3)?,
                        &client,
                        AmazonS3Builder::with_config,
                        AmazonS3ConfigKey::Client,
                    )
                    .with_url(url.as_str())
                    .with_retry(no_retries)
                    .build()
                    .map_err(|e| config_error(e.to_string()))?,
                );
                published = Some((Urls::Presigned(s3.clone()), Convention::S3));
                paged(s3)
            }
            ObjectStoreScheme::GoogleCloudStorage => {
                use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
                let builder = configured(
                    GoogleCloudStorageBuilder::new(),
                    settings(Cloud::Gcs)?,
                    &client,
                    GoogleCloudStorageBuilder::with_config,
                    GoogleConfigKey::Client,
                )
                .with_url(url.as_str())
                .with_retry(no_retries);
                let gcs = Arc::new(builder.clone().build().map_err(|e| config_error(e.to_string()))?);
                // An emulator is sent no credentials: its signer would go looking for some
                // (the metadata server, Google's signing service).
                let unsigned = builder
                    .get_config_value(&GoogleConfigKey::SkipSignature)
                    .as_deref()
                    == Some("true");
                let urls = if unsigned {
                    let base = builder
                        .get_config_value(&GoogleConfigKey::BaseUrl)
                        .unwrap_or_else(|| "https://storage.googleapis.com".to_owned());
                    // `gs://BUCKET/...` (the builder reads its URL only when it builds).
                    let bucket = url.host_str().unwrap_or_default();
                    Urls::Unsigned(format!("{}/{bucket}", base.trim_end_matches('/')))
                } else {
                    Urls::Presigned(gcs.clone())
                };
                published = Some((urls, Convention::Gcs));
                paged(gcs)
            }
            ObjectStoreScheme::MicrosoftAzure => {
                use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
                let azure = Arc::new(
                    configured(
                        MicrosoftAzureBuilder::new(),
                        settings(Cloud::Azure)?,
                        &client,
                        MicrosoftAzureBuilder::with_config,
                        AzureConfigKey::Client,
                    )
                    .with_url(url.as_str())
                    .with_retry(no_retries)
                    .build()
                    .map_err(|e| config_error(e.to_string()))?,
                );
                published = Some((Urls::Presigned(azure.clone()), Convention::Azure));
                paged(azure)
            }
            ObjectStoreScheme::Http => {
                let mut base = url.clone();
                base.set_path("");
                // A source written with http:// is meant as it is (object_store refuses plain
                // HTTP unless told).
                let plain = (ClientConfigKey::AllowHttp, (url.scheme() == "http").to_string());
                let mut options = client
                    .iter()
                    .chain([&plain])
                    .fold(ClientOptions::new(), |o, (k, v)| o.with_config(*k, v));
                // The URL's user and password are its credentials, sent as HTTP Basic: the
                // client takes none from the URL (and its errors would quote them).
                if !url.username().is_empty() {
                    let decoded = |s: &str| {
                        percent_encoding::percent_decode_str(s)
                            .decode_utf8_lossy()
                            .into_owned()
                    };
                    let pair = format!(
                        "{}:{}",
                        decoded(url.username()),
                        decoded(url.password().unwrap_or_default())
                    );
                    let mut value =
                        reqwest::header::HeaderValue::from_str(&format!("Basic {}", BASE64.encode(pair)))
                            .map_err(|e| config_error(format!("the URL's user and password: {e}")))?;
                    value.set_sensitive(true);
                    let headers =
                        reqwest::header::HeaderMap::from_iter([(reqwest::header::AUTHORIZATION, value)]);
                    options = options.with_default_headers(headers);
                    // Neither can fail on a URL with a host, which an http(s) URL has.
                    let _ = base.set_username("");
                    let _ = base.set_password(None);
                }
                let store: Arc<dyn ObjectStore> = Arc::new(
                    object_store::http::HttpBuilder::new()
                        .with_client_options(options)
                        .with_url(base.as_str())
                        .with_retry(no_retries)
                        .build()
                        .map_err(|e| config_error(e.to_string()))?,
                );
                (store, None)
            }
            other => return Err(config_error(format!("{other:?} stores are not supported"))),
        };
        let local_prefix = if matches!(scheme, ObjectStoreScheme::Local) {
            Path::default()
        } else {
            prefix
        };
        let origin = Self::new(
            &source.name,
            source.url.as_str(),
            store,
            local_prefix,
            config,
            stats,
        );
        let origin = match pager {
            Some(pager) => origin.with_pager(pager),
            None => origin,
        };
        Ok(match published {
            Some((urls, convention)) => {
                let checksums = PublishedChecksums::new(urls, convention, config.request_timeout)
                    .map_err(|e| config_error(format!("cannot build an HTTP client: {e}")))?;
                origin.with_published_checksums(checksums)
            }
            None => origin,
        })
    }
}
