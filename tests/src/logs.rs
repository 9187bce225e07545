//! The log of a test process, captured: a subscriber of the whole process (so one test binary
//! that captures logs holds only tests that do), keeping every event at any level.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};

/// One captured event: its level and every field, message included, as ` name=value` text.
#[derive(Debug, Clone)]
pub struct Event {
    /// The event's level.
    pub level: tracing::Level,
    /// Its fields.
    pub text: String,
}

struct Capture(Arc<Mutex<Vec<Event>>>);

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={value:?}", field.name());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = write!(self.0, " {}={value}", field.name());
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut fields = Fields(String::new());
        event.record(&mut fields);
        let captured = Event {
            level: *event.metadata().level(),
            text: fields.0,
        };
        self.0.lock().expect("log").push(captured);
    }
}

/// The events of the process, captured from the first call on.
fn log() -> &'static Mutex<Vec<Event>> {
    static LOG: OnceLock<Arc<Mutex<Vec<Event>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let events = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(Capture(events.clone()));
        tracing::subscriber::set_global_default(subscriber).expect("one subscriber");
        events
    })
}

/// Starts capturing, if not yet: call it before what is to be logged.
pub fn capture() {
    log();
}

/// The captured events whose text holds `needle`.
pub fn events_containing(needle: &str) -> Vec<Event> {
    let events = log().lock().expect("log");
    events
        .iter()
        .filter(|event| event.text.contains(needle))
        .cloned()
        .collect()
}
