//! A fault-injecting, request-logging wrapper around a real `ObjectStore`.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetRange, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, Result,
};
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What kind of request the store saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// A GET (ranged or whole).
    Get,
    /// A HEAD.
    Head,
    /// A listing.
    List,
    /// Anything that writes or deletes.
    Write,
}

/// One logged request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Its kind.
    pub kind: RequestKind,
    /// The location.
    pub path: String,
    /// The byte range of a ranged GET.
    pub range: Option<Range<u64>>,
}

/// Faults to inject, each with its probability per request.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Reads (GET, HEAD, LIST) answered with a 503 Slow Down before any byte.
    pub unavailable: f64,
    /// GET bodies cut by a connection reset after `cut_after` bytes.
    pub cut_body: f64,
    /// Where a cut body stops.
    pub cut_after: u64,
    /// How long every GET waits before it is answered (a slow origin).
    pub get_delay: Duration,
}

/// Forwards every `ObjectStore` method to `inner`, logging it and injecting faults.
pub struct FaultStore {
    inner: Arc<dyn ObjectStore>,
    plan: Mutex<FaultPlan>,
    rng: Mutex<StdRng>,
    log: Mutex<Vec<Request>>,
    /// GETs answered or being answered whose body has not been dropped yet.
    gets_in_flight: Arc<AtomicUsize>,
    peak_gets_in_flight: AtomicUsize,
}

/// Counts one GET in flight until it is dropped.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl fmt::Debug for FaultStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultStore({})", self.inner)
    }
}

impl fmt::Display for FaultStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultStore({})", self.inner)
    }
}

fn unavailable() -> object_store::Error {
    object_store::Error::Generic {
        store: "fault",
        source: "injected 503 Slow Down".into(),
    }
}

impl FaultStore {
    /// Wraps `inner` with no faults.
    pub fn new(inner: Arc<dyn ObjectStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            plan: Mutex::new(FaultPlan::default()),
            rng: Mutex::new(StdRng::seed_from_u64(0x001a_2de2)),
            log: Mutex::new(Vec::new()),
            gets_in_flight: Arc::new(AtomicUsize::new(0)),
            peak_gets_in_flight: AtomicUsize::new(0),
        })
    }

    /// The most GETs in flight at once so far, from the request until its body is dropped.
    pub fn peak_gets_in_flight(&self) -> usize {
        self.peak_gets_in_flight.load(Ordering::Relaxed)
    }

    fn get_started(&self) -> InFlight {
        let now = self.gets_in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak_gets_in_flight.fetch_max(now, Ordering::Relaxed);
        InFlight(self.gets_in_flight.clone())
    }

    /// Replaces the fault plan.
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.plan.lock() = plan;
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Request> {
        self.log.lock().clone()
    }

    /// The GETs so far.
    pub fn gets(&self) -> Vec<Request> {
        self.requests()
            .into_iter()
            .filter(|r| r.kind == RequestKind::Get)
            .collect()
    }

    /// Forgets the log.
    pub fn clear_log(&self) {
        self.log.lock().clear();
    }

    fn record(&self, kind: RequestKind, path: &Path, range: Option<Range<u64>>) {
        self.log.lock().push(Request {
            kind,
            path: path.to_string(),
            range,
        });
    }

    fn roll(&self, probability: f64) -> bool {
        probability > 0.0 && self.rng.lock().random::<f64>() < probability
    }

    fn maybe_unavailable(&self) -> Result<()> {
        let probability = self.plan.lock().unavailable;
        if self.roll(probability) {
            Err(unavailable())
        } else {
            Ok(())
        }
    }
}

#[async_trait]
#[deny(clippy::missing_trait_methods)]
impl ObjectStore for FaultStore {
    async fn put_opts(&self, location: &Path, payload: PutPayload, opts: PutOptions) -> Result<PutResult> {
        self.record(RequestKind::Write, location, None);
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.record(RequestKind::Write, location, None);
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let range = match &options.range {
            Some(GetRange::Bounded(r)) => Some(r.clone()),
            _ => None,
        };
        let kind = if options.head {
            RequestKind::Head
        } else {
            RequestKind::Get
        };
        self.record(kind, location, range);
        let in_flight = (kind == RequestKind::Get).then(|| self.get_started());
        let plan = self.plan.lock().clone();
        if kind == RequestKind::Get && !plan.get_delay.is_zero() {
            tokio::time::sleep(plan.get_delay).await;
        }
        self.maybe_unavailable()?;
        let mut result = self.inner.get_opts(location, options).await?;
        if kind == RequestKind::Get && self.roll(plan.cut_body) {
            let empty = GetResultPayload::Stream(futures::stream::empty().boxed());
            result.payload = match std::mem::replace(&mut result.payload, empty) {
                GetResultPayload::Stream(body) => GetResultPayload::Stream(cut_after(body, plan.cut_after)),
                file => file,
            };
        }
        if let Some(in_flight) = in_flight {
            // In flight until the body is dropped.
            let empty = GetResultPayload::Stream(futures::stream::empty().boxed());
            result.payload = match std::mem::replace(&mut result.payload, empty) {
                GetResultPayload::Stream(body) => GetResultPayload::Stream(
                    body.map(move |chunk| {
                        let _in_flight = &in_flight;
                        chunk
                    })
                    .boxed(),
                ),
                file => file,
            };
        }
        Ok(result)
    }

    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        for range in ranges {
            self.record(RequestKind::Get, location, Some(range.clone()));
        }
        self.maybe_unavailable()?;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(&self, locations: BoxStream<'static, Result<Path>>) -> BoxStream<'static, Result<Path>> {
        self.record(RequestKind::Write, &Path::default(), None);
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.record(RequestKind::List, prefix.unwrap_or(&Path::default()), None);
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, Result<ObjectMeta>> {
        self.record(RequestKind::List, prefix.unwrap_or(&Path::default()), None);
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.record(RequestKind::List, prefix.unwrap_or(&Path::default()), None);
        self.maybe_unavailable()?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.record(RequestKind::Write, to, None);
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(&self, from: &Path, to: &Path, options: RenameOptions) -> Result<()> {
        self.record(RequestKind::Write, to, None);
        self.inner.rename_opts(from, to, options).await
    }
}

/// Ends `body` with a reset after `limit` bytes.
fn cut_after(body: BoxStream<'static, Result<Bytes>>, limit: u64) -> BoxStream<'static, Result<Bytes>> {
    futures::stream::unfold((body, 0u64, false), move |(mut body, sent, done)| async move {
        if done {
            return None;
        }
        if sent >= limit {
            let reset = object_store::Error::Generic {
                store: "fault",
                source: "injected connection reset".into(),
            };
            return Some((Err(reset), (body, sent, true)));
        }
        match body.next().await? {
            Ok(chunk) => {
                let keep = chunk.slice(..chunk.len().min((limit - sent) as usize));
                let sent = sent + keep.len() as u64;
                Some((Ok(keep), (body, sent, false)))
            }
            Err(e) => Some((Err(e), (body, sent, true))),
        }
    })
    .boxed()
}
