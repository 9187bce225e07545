//! Secrets in URLs, kept out of everything Larder prints.
//!
//! A source URL may carry credentials: a user and password (`https://alice:pw@host/x`) or a
//! signed query (`?sv=...&sig=...`, `?X-Amz-Signature=...`). [`Redacted`] is the one way
//! such text is shown: in logs, `larder status`, errors. It hides, in every URL of the text:
//! - the user info (user and password) before the host, as `***`; an `abfs://` or `abfss://`
//!   user without a password names the container and is kept;
//! - the value of every query parameter (names are kept: `?sig=***`), and a parameter
//!   without a value. No list of harmless parameters is kept: Larder reads none, an
//!   `http(s)://` source sends its query with every request, and signature parameters are
//!   named differently by every store;
//! - the fragment.
//!
//! [`SourceUrl`] holds a configured URL and shows itself only this way.
//!
//! A secret can also show outside a URL: a server that echoes the request it refused (the
//! query, an `Authorization: Basic` header) puts it in the error Larder reports. So every
//! secret value the process is given (a source URL's user, password and query values, the
//! Basic form of the first two, cloud keys and tokens from the environment, a registry's
//! password) is recorded with [`hide_secret`], and [`Redacted`] hides it wherever it shows, at
//! least four bytes long.

use std::fmt;
use std::sync::RwLock;

use serde::{Deserialize, Serialize};

/// What a hidden part of a URL is replaced by.
const HIDDEN: &str = "***";

/// Whether `c` ends a URL inside free text; `in_parentheses`: the URL follows a `(`.
fn ends_url(c: char, in_parentheses: bool) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`') || (in_parentheses && c == ')')
}

/// Where the scheme that ends `before_separator` (the text before a `://`) starts.
fn start_of_scheme(before_separator: &str) -> usize {
    before_separator
        .char_indices()
        .rev()
        .find(|&(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
        .map_or(0, |(i, c)| i + c.len_utf8())
}

/// Secret values this process was given, hidden by [`Redacted`] wherever they show up, longest
/// first (see [`hide_secret`]).
static KNOWN: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// The shortest value hidden as a known secret: a shorter one would hide bits of ordinary words.
pub(crate) const KNOWN_SECRET_MIN_LEN: usize = 4;

/// Hides `secret` in everything [`Redacted`] shows from now on, wherever it appears and
/// whatever quotes it (a server that echoes a request in its error, a library's debug line),
/// and its percent-decoded form. Values shorter than four bytes are not taken.
pub fn hide_secret(secret: &str) {
    let decoded = percent_decoded(secret);
    let mut known = KNOWN.write().unwrap_or_else(std::sync::PoisonError::into_inner);
    for value in [secret, decoded.as_str()] {
        if value.len() >= KNOWN_SECRET_MIN_LEN && !known.iter().any(|k| k == value) {
            known.push(value.to_owned());
        }
    }
    known.sort_by_key(|k| std::cmp::Reverse(k.len()));
}

/// Hides a user and password, and the `Authorization: Basic` value HTTP carries them in.
pub fn hide_credentials(user: &str, password: &str) {
    use base64::Engine as _;
    hide_secret(password);
    hide_secret(user);
    let basic = |user: &str, password: &str| {
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
    };
    hide_secret(&basic(user, password));
    hide_secret(&basic(&percent_decoded(user), &percent_decoded(password)));
}

/// Hides the secrets a URL carries: its user and password (and their Basic form), and the
/// value of each query parameter.
pub(crate) fn hide_url_secrets(url: &str) {
    let Ok(parsed) = url::Url::parse(url) else {
        return;
    };
    if parsed.username().is_empty() {
        parsed.password().into_iter().for_each(hide_secret);
    } else {
        hide_credentials(parsed.username(), parsed.password().unwrap_or_default());
    }
    for (_, value) in parsed.query_pairs() {
        hide_secret(&value);
    }
    if let Some(query) = parsed.query() {
        for parameter in query.split('&') {
            hide_secret(parameter.split_once('=').map_or(parameter, |(_, value)| value));
        }
    }
}

/// `text` with its `%XX` escapes decoded (what a server sees of a URL's part).
fn percent_decoded(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

/// `text` with every known secret (see [`hide_secret`]) replaced by `***`.
fn hide_known(text: &str) -> std::borrow::Cow<'_, str> {
    let known = KNOWN.read().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut text = std::borrow::Cow::Borrowed(text);
    for secret in known.iter() {
        if text.contains(secret.as_str()) {
            text = std::borrow::Cow::Owned(text.replace(secret.as_str(), HIDDEN));
        }
    }
    text
}

/// `text` with the secrets of every URL in it hidden (see the module docs), and every secret
/// value the process was given ([`hide_secret`]), wherever it shows.
#[derive(Debug, Clone, Copy)]
pub struct Redacted<'a>(pub &'a str);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hide_known(&UrlsHidden(self.0).to_string()))
    }
}

/// `text` with the secrets of every URL in it hidden.
struct UrlsHidden<'a>(&'a str);

impl fmt::Display for UrlsHidden<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(at) = rest.find("://") {
            let scheme_start = start_of_scheme(&rest[..at]);
            let scheme = &rest[scheme_start..at];
            f.write_str(&rest[..at + 3])?;
            let after = &rest[at + 3..];
            let in_parentheses = rest[..scheme_start].ends_with('(');
            let mut end = after.find(|c| ends_url(c, in_parentheses)).unwrap_or(after.len());
            // A URL inside this one (`s3://b/https://user:pw@host`) is shown as a URL of
            // its own, so that its user info is found.
            if let Some(inner) = after[..end].find("://") {
                end = start_of_scheme(&after[..inner]);
            }
            write_url(f, scheme, &after[..end])?;
            rest = &after[end..];
        }
        f.write_str(rest)
    }
}

/// Writes the part of a URL after `scheme://` with its secrets hidden.
fn write_url(f: &mut fmt::Formatter<'_>, scheme: &str, url: &str) -> fmt::Result {
    let (before_query, fragment) = match url.split_once('#') {
        Some((before, fragment)) => (before, Some(fragment)),
        None => (url, None),
    };
    let (before_query, query) = match before_query.split_once('?') {
        Some((before, query)) => (before, Some(query)),
        None => (before_query, None),
    };
    // The user info ends at the authority's last `@`. The authority ends at the first `/`
    // where the text is a URL; where it is not (a password with a `/` in it makes the rest
    // look like a path), every `@` before the query counts, so that no part of the
    // password shows.
    let authority_end = before_query.find(['/', '\\']).unwrap_or(before_query.len());
    let parses = url::Url::parse(&format!("{scheme}://{before_query}")).is_ok();
    let userinfo_end = if parses {
        before_query[..authority_end].rfind('@')
    } else {
        before_query.rfind('@')
    };
    let rest = match userinfo_end {
        Some(at) => {
            let userinfo = &before_query[..at];
            let container = matches!(scheme, "abfs" | "abfss") && !userinfo.contains(':');
            f.write_str(if container { userinfo } else { HIDDEN })?;
            &before_query[at..]
        }
        None => before_query,
    };
    f.write_str(rest)?;
    if let Some(query) = query {
        f.write_str("?")?;
        for (i, parameter) in query.split('&').enumerate() {
            if i > 0 {
                f.write_str("&")?;
            }
            match parameter.split_once('=') {
                Some((name, "")) => write!(f, "{name}=")?,
                Some((name, _)) => write!(f, "{name}={HIDDEN}")?,
                None if parameter.is_empty() => {}
                None => f.write_str(HIDDEN)?,
            }
        }
    }
    if let Some(fragment) = fragment {
        f.write_str("#")?;
        if !fragment.is_empty() {
            f.write_str(HIDDEN)?;
        }
    }
    Ok(())
}

/// A source's URL as configured. It is shown ([`fmt::Display`], [`fmt::Debug`]) only with
/// its secrets hidden ([`Redacted`]); [`SourceUrl::as_str`] gives the whole URL, for
/// building the store and nothing that is printed.
#[derive(Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(transparent)]
pub struct SourceUrl(String);

impl SourceUrl {
    /// The URL as written, secrets included: never print it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Trims leading and trailing whitespace.
    pub(crate) fn trim(&mut self) {
        let trimmed = self.0.trim();
        if trimmed.len() != self.0.len() {
            self.0 = trimmed.to_owned();
        }
    }
}

impl From<String> for SourceUrl {
    fn from(url: String) -> Self {
        Self(url)
    }
}

impl From<&str> for SourceUrl {
    fn from(url: &str) -> Self {
        Self(url.to_owned())
    }
}

impl fmt::Display for SourceUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Redacted(&self.0).fmt(f)
    }
}

impl fmt::Debug for SourceUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{self}\"")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(text: &str) -> String {
        Redacted(text).to_string()
    }

    /// A secret the process was given is hidden outside any URL too: in a request a server
    /// echoed, the query's value and the Basic header's base64. A value shorter than four
    /// bytes is not taken (it would hide bits of words).
    #[test]
    fn a_known_secret_is_hidden_wherever_it_shows() {
        use base64::Engine as _;
        hide_url_secrets("http://unit-user:Unit%2BPass@host/x?sig=Unit-Sig-9");
        let basic = base64::engine::general_purpose::STANDARD.encode("unit-user:Unit+Pass");
        let echoed = format!("GET /x?sig=Unit-Sig-9 HTTP/1.1\nAuthorization: Basic {basic}\npw Unit+Pass");
        assert_eq!(
            shown(&echoed),
            "GET /x?sig=*** HTTP/1.1\nAuthorization: Basic ***\npw ***"
        );
        hide_secret("abc");
        assert_eq!(shown("abc"), "abc");
    }

    #[test]
    fn user_info_is_hidden() {
        assert_eq!(shown("https://alice:PW@host/x"), "https://***@host/x");
        assert_eq!(shown("s3://alice@bucket/models"), "s3://***@bucket/models");
        assert_eq!(shown("s3://AKIA:se/cret+key@bucket/p"), "s3://***@bucket/p");
        assert_eq!(shown("https://a:b@c@host:8443/x"), "https://***@host:8443/x");
        // An `@` in the path of a URL is not user info.
        assert_eq!(shown("s3://bucket/user@example/x"), "s3://bucket/user@example/x");
        // An abfs user is the container, unless a password follows it.
        assert_eq!(
            shown("abfss://data@account.dfs.core.windows.net/x"),
            "abfss://data@account.dfs.core.windows.net/x"
        );
        assert_eq!(
            shown("abfss://data:PW@account.dfs.core.windows.net/x"),
            "abfss://***@account.dfs.core.windows.net/x"
        );
    }

    /// A scheme starts after the last character that cannot be in one, however many bytes
    /// that character takes (a fuzzed source URL once split one in half), and a URL inside
    /// another is a URL of its own.
    #[test]
    fn where_a_scheme_starts() {
        assert_eq!(shown("\u{1970}://x"), "\u{1970}://x");
        assert_eq!(shown("é s3://a:PW@b/c"), "é s3://***@b/c");
        assert_eq!(shown("(ü)s3://a:PW@b/c"), "(ü)s3://***@b/c");
        assert_eq!(
            shown("s3://b/https://u:PW@h/x?sig=S"),
            "s3://b/https://***@h/x?sig=***"
        );
        assert_eq!(shown("a://0://a:PW@"), "a://0://***@");
    }

    #[test]
    fn query_values_and_fragment_are_hidden() {
        assert_eq!(
            shown("https://acct.blob.core.windows.net/c?sv=2024&se=2030&sig=S%2Bx&sp=rl"),
            "https://acct.blob.core.windows.net/c?sv=***&se=***&sig=***&sp=***"
        );
        assert_eq!(
            shown("https://b.s3.amazonaws.com/k?X-Amz-Credential=A&X-Amz-Signature=S&X-Amz-Security-Token=T"),
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***"
        );
        assert_eq!(
            shown("https://h/x?token&a=&b=1#frag"),
            "https://h/x?***&a=&b=***#***"
        );
        assert_eq!(shown("https://u:p@h?code=1"), "https://***@h?code=***");
    }

    #[test]
    fn urls_inside_text_are_found_and_the_rest_is_kept() {
        assert_eq!(
            shown("error sending request for url (http://h:1/b/k?sig=S): reset; again s3://u:p@b"),
            "error sending request for url (http://h:1/b/k?sig=***): reset; again s3://***@b"
        );
        assert_eq!(
            shown("source a (az://u:p@c?sig=S): no"),
            "source a (az://***@c?sig=***): no"
        );
        assert_eq!(
            shown("invalid --source = \"a=https://u:p@h/x?sig=S\": nope"),
            "invalid --source = \"a=https://***@h/x?sig=***\": nope"
        );
        for plain in [
            "",
            "models",
            "s3://bucket/prefix",
            "file:///data/models",
            "no url here: a=b?c",
        ] {
            assert_eq!(shown(plain), plain);
        }
    }

    #[test]
    fn a_source_url_shows_only_redacted() {
        let url = SourceUrl::from("https://alice:PW@host/x?sig=S");
        assert_eq!(url.to_string(), "https://***@host/x?sig=***");
        assert_eq!(format!("{url:?}"), "\"https://***@host/x?sig=***\"");
        assert_eq!(url.as_str(), "https://alice:PW@host/x?sig=S");
    }
}
