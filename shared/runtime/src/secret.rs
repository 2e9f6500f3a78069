//! Keeping secrets out of what is shown: [`Secret`], the one type a password or key is
//! kept in, and URLs as they may be printed or stored, without their credentials. Settings
//! and the model client both use it.

use std::fmt;

/// A setting that must never be shown: a database URL (its password), an API key, a token
/// list, a token's digest. `{:?}` and `{}` show a URL without its user name and password
/// (the host stays visible, e.g. `postgres://db:5432/turnlog`) and anything else as `***`;
/// the value itself only through [`Secret::expose`].
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret<T = String>(T);

impl<T> Secret<T> {
    pub fn new(value: T) -> Self {
        Self(value)
    }

    /// The value itself, for the one place that uses it (a connection, a header).
    pub fn expose(&self) -> &T {
        &self.0
    }
}

impl Secret {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.contains("://") {
            f.write_str(&redacted_url(&self.0))
        } else {
            f.write_str("***")
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({self})")
    }
}

/// A digest (of an API token): shown as `***` too, since a digest of a short token can be
/// reversed by trying.
impl fmt::Debug for Secret<[u8; 32]> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// `url` as it may be printed: without the user name and password a gateway URL can carry
/// (`https://user:pw@gw/v1`; reqwest sends them as Basic auth, nothing else may show them),
/// and with its query shown as `?…` (`postgres://db/turnlog?password=…` is a valid
/// database URL).
pub fn redacted_url(url: &str) -> String {
    let (before, host, after) = split_authority(url);
    match after.split_once('?') {
        Some((path, query)) => {
            let fragment = query.find('#').map_or("", |i| &query[i..]);
            format!("{before}{host}{path}?…{fragment}")
        }
        None => format!("{before}{host}{after}"),
    }
}

/// The gateway's host, with its port when the URL names one: who served a turn, as stored
/// in the log. Never the credentials, path or query.
pub fn gateway_host(url: &str) -> String {
    split_authority(url).1.to_owned()
}

/// `url` cut around its authority's host: what comes before (scheme and `://`), the host
/// and port without any `userinfo@`, and what follows (path, query, fragment).
fn split_authority(url: &str) -> (&str, &str, &str) {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..].find(['/', '?', '#']).map_or(url.len(), |i| start + i);
    let authority = &url[start..end];
    // The userinfo ends at the authority's last `@` (a password may contain `@` escaped or not).
    let host = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    (&url[..start], host, &url[end..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_shown_and_stored_without_credentials() {
        for (url, shown, host) in [
            ("https://user:pw@gw/v1", "https://gw/v1", "gw"),
            ("http://key@10.0.0.5:8000/v1/", "http://10.0.0.5:8000/v1/", "10.0.0.5:8000"),
            ("https://u:p@ss@gw.example?x=@y", "https://gw.example?…", "gw.example"),
            ("postgres://db:5432/t?password=pw#f", "postgres://db:5432/t?…#f", "db:5432"),
            ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1", "127.0.0.1:9"),
            ("http://[::1]:9/v1", "http://[::1]:9/v1", "[::1]:9"),
            ("gw:8000/v1", "gw:8000/v1", "gw:8000"),
            ("user:pw@gw/v1", "gw/v1", "gw"),
        ] {
            assert_eq!(redacted_url(url), shown, "{url}");
            assert_eq!(gateway_host(url), host, "{url}");
        }
    }
}
