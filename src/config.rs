//! Mount settings: one set of keys shared by the TOML configuration file (`--config`), the
//! `-o key=value` mount options (fstab, `mount -t fuse.pmstack`) and the command-line flags.
//!
//! Precedence, lowest first: built-in defaults, the configuration file, `-o` options, flags.
//! Every key is validated by one function ([`Settings::set`]), so a bad value is reported the
//! same way wherever it came from: the key, the value, and what is allowed.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::core::Mode;

/// Where the daemon's logs go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogTarget {
    Stderr,
    Journald,
    Syslog,
}

/// Kernel page-cache mode for writes through the mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheMode {
    Writethrough,
    Writeback,
}

/// Every mount setting, resolved.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    pub lower: Option<PathBuf>,
    pub mountpoint: Option<PathBuf>,
    pub mode: Mode,
    pub pm: Option<PathBuf>,
    pub pm_size: u64,
    pub flush_interval_ms: u64,
    pub low_watermark: f64,
    pub throttle_share: f64,
    pub sensitivity: u64,
    /// Seconds the kernel may cache attributes and entries; None: `auto` (see
    /// `attr_timeout_for`).
    pub attr_timeout: Option<f64>,
    pub cache: CacheMode,
    pub kernel_passthrough: bool,
    pub threads: usize,
    pub log_level: String,
    pub log_target: LogTarget,
    pub metrics_addr: Option<String>,
    pub allow_other: bool,
    pub default_permissions: bool,
    pub ro: bool,
    pub noatime: bool,
    pub nodev: bool,
    pub nosuid: bool,
    pub noexec: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            lower: None,
            mountpoint: None,
            mode: Mode::Sync,
            pm: None,
            pm_size: 256 << 20,
            flush_interval_ms: 5000,
            low_watermark: 0.25,
            throttle_share: 0.2,
            sensitivity: 2,
            attr_timeout: None,
            cache: CacheMode::Writethrough,
            kernel_passthrough: true,
            threads: 2,
            log_level: "warn".into(),
            log_target: LogTarget::Stderr,
            metrics_addr: None,
            allow_other: false,
            default_permissions: false,
            ro: false,
            noatime: false,
            nodev: false,
            nosuid: false,
            noexec: false,
        }
    }
}

/// The keys, each with what it accepts (shown in errors and in `pmstack mount --help`).
pub const KEYS: &[(&str, &str)] = &[
    ("lower", "the lower directory (config file only; a path)"),
    ("mountpoint", "the mount point (config file only; a path)"),
    ("mode", "sync, strict, adaptive, passthrough"),
    (
        "pm",
        "a path: /dev/daxX.Y, a file on an fsdax mount, or any file (emulated)",
    ),
    ("pm_size", "a size such as 256M or 4G (at least 256K)"),
    ("flush_interval_ms", "an integer from 1 to 86400000"),
    ("low_watermark", "a number from 0 to 1"),
    ("throttle_share", "a number from 0 to 1"),
    ("sensitivity", "an integer from 1 to 1000000"),
    ("attr_timeout", "auto, or seconds: a number from 0 to 86400"),
    ("cache", "writethrough, writeback"),
    ("kernel_passthrough", "true, false"),
    ("threads", "an integer from 1 to 64"),
    (
        "log_level",
        "error, warn, info, debug, trace, or a tracing filter such as pmstack=debug",
    ),
    ("log_target", "stderr, journald, syslog"),
    ("metrics_addr", "an address such as 127.0.0.1:9464, or off"),
    ("allow_other", "true, false"),
    ("default_permissions", "true, false"),
    ("ro", "true, false"),
    ("noatime", "true, false"),
    ("nodev", "true, false"),
    ("nosuid", "true, false"),
    ("noexec", "true, false"),
];

/// Mount options that mount(8), fstab and systemd pass to every helper and that mean nothing
/// (or the default) for pmstack: accepted and ignored. `x-*` and `comment=*` are ignored too.
const IGNORED_OPTIONS: &[&str] = &[
    "rw",
    "defaults",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "nofail",
    "_netdev",
    "dev",
    "suid",
    "exec",
    "async",
    "atime",
    "relatime",
    "strictatime",
    "lazytime",
    "nolazytime",
];

/// A rejected setting: where it came from, the key, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct SettingError {
    pub source: String,
    pub key: String,
    pub msg: String,
}

impl fmt::Display for SettingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}: {}", self.source, self.msg)
        } else {
            write!(f, "{}: key '{}': {}", self.source, self.key, self.msg)
        }
    }
}

impl std::error::Error for SettingError {}

/// Parse a size such as `4096`, `256K`, `256M`, `4G`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        Some('T' | 't') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| format!("invalid size '{s}' (use e.g. 256M or 1G)"))
}

fn allowed(key: &str) -> &'static str {
    KEYS.iter()
        .find(|(k, _)| *k == key)
        .map(|(_, a)| *a)
        .unwrap_or("")
}

fn known_keys() -> String {
    KEYS.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
}

fn normalize(key: &str) -> String {
    key.trim().replace('-', "_")
}

impl Settings {
    /// Set one key from its text form. The error names the value and what is allowed.
    pub fn set(&mut self, key: &str, val: &str) -> Result<(), String> {
        let key = normalize(key);
        let v = val.trim();
        let bad = || format!("invalid value '{v}' (allowed: {})", allowed(&key));
        let boolean = |v: &str| match v {
            "true" | "yes" | "on" | "1" => Ok(true),
            "false" | "no" | "off" | "0" => Ok(false),
            _ => Err(bad()),
        };
        let share = |v: &str| match v.parse::<f64>() {
            Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
            _ => Err(bad()),
        };
        let int = |v: &str, lo: u64, hi: u64| match v.parse::<u64>() {
            Ok(x) if (lo..=hi).contains(&x) => Ok(x),
            _ => Err(bad()),
        };
        let path = |v: &str| {
            if v.is_empty() {
                Err(bad())
            } else {
                Ok(PathBuf::from(v))
            }
        };
        match key.as_str() {
            "lower" => self.lower = Some(path(v)?),
            "mountpoint" => self.mountpoint = Some(path(v)?),
            "mode" => {
                self.mode = match v {
                    "sync" => Mode::Sync,
                    "strict" => Mode::Strict,
                    "adaptive" => Mode::Adaptive,
                    "passthrough" => Mode::Passthrough,
                    _ => return Err(bad()),
                }
            }
            "pm" => self.pm = Some(path(v)?),
            "pm_size" => {
                self.pm_size = match parse_size(v) {
                    Ok(n) if n >= 256 << 10 => n,
                    _ => return Err(bad()),
                }
            }
            "flush_interval_ms" => self.flush_interval_ms = int(v, 1, 86_400_000)?,
            "low_watermark" => self.low_watermark = share(v)?,
            "throttle_share" => self.throttle_share = share(v)?,
            "sensitivity" => self.sensitivity = int(v, 1, 1_000_000)?,
            "attr_timeout" => {
                self.attr_timeout = match v.parse::<f64>() {
                    _ if v == "auto" => None,
                    Ok(x) if (0.0..=86400.0).contains(&x) => Some(x),
                    _ => return Err(bad()),
                }
            }
            "cache" => {
                self.cache = match v {
                    "writethrough" => CacheMode::Writethrough,
                    "writeback" => CacheMode::Writeback,
                    _ => return Err(bad()),
                }
            }
            "kernel_passthrough" => self.kernel_passthrough = boolean(v)?,
            "threads" => self.threads = int(v, 1, 64)? as usize,
            "log_level" => {
                if v.is_empty() || tracing_subscriber::EnvFilter::try_new(v).is_err() {
                    return Err(bad());
                }
                self.log_level = v.to_string();
            }
            "log_target" => {
                self.log_target = match v {
                    "stderr" => LogTarget::Stderr,
                    "journald" => LogTarget::Journald,
                    "syslog" => LogTarget::Syslog,
                    _ => return Err(bad()),
                }
            }
            "metrics_addr" => {
                self.metrics_addr = match v {
                    "off" | "" => None,
                    a if a.parse::<std::net::SocketAddr>().is_ok() => Some(a.to_string()),
                    _ => return Err(bad()),
                }
            }
            "allow_other" => self.allow_other = boolean(v)?,
            "default_permissions" => self.default_permissions = boolean(v)?,
            "ro" => self.ro = boolean(v)?,
            "noatime" => self.noatime = boolean(v)?,
            "nodev" => self.nodev = boolean(v)?,
            "nosuid" => self.nosuid = boolean(v)?,
            "noexec" => self.noexec = boolean(v)?,
            _ => return Err(format!("unknown key (known keys: {})", known_keys())),
        }
        Ok(())
    }

    /// Apply a TOML configuration file's text. `source` names it in errors.
    pub fn apply_toml(&mut self, text: &str, source: &str) -> Result<(), SettingError> {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| SettingError {
            source: source.to_string(),
            key: String::new(),
            msg: match e.span() {
                // 1-based line of the error, as editors number them.
                Some(sp) => format!(
                    "not valid TOML at line {}: {}",
                    text[..sp.start.min(text.len())].matches('\n').count() + 1,
                    e.message().trim()
                ),
                None => format!("not valid TOML: {}", e.message().trim()),
            },
        })?;
        for (k, v) in &table {
            let err = |msg: String| SettingError {
                source: source.to_string(),
                key: k.clone(),
                msg,
            };
            let text = match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                other => {
                    // Still report an unknown key as unknown, not as a bad type.
                    if !KEYS.iter().any(|(kk, _)| *kk == normalize(k)) {
                        return Err(err(format!("unknown key (known keys: {})", known_keys())));
                    }
                    return Err(err(format!(
                        "a {} is not accepted here (allowed: {})",
                        other.type_str(),
                        allowed(&normalize(k))
                    )));
                }
            };
            self.set(k, &text).map_err(err)?;
        }
        Ok(())
    }

    /// Read and apply a configuration file.
    pub fn apply_file(&mut self, path: &Path) -> Result<(), SettingError> {
        let text = std::fs::read_to_string(path).map_err(|e| SettingError {
            source: format!("config {}", path.display()),
            key: String::new(),
            msg: format!("cannot read it ({e})"),
        })?;
        self.apply_toml(&text, &format!("config {}", path.display()))
    }

    /// Apply a mount option string (`-o a=b,c,…`, fstab's fourth field). `config=PATH` loads a
    /// file at that point; options mount(8) passes to every helper are ignored. Returns nothing
    /// else: every accepted option changes a setting.
    pub fn apply_options(&mut self, opts: &str) -> Result<(), SettingError> {
        for o in opts.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = match o.split_once('=') {
                Some((k, v)) => (k, v),
                None => (o, "true"),
            };
            if IGNORED_OPTIONS.contains(&o) || k.starts_with("x-") || k == "comment" {
                continue;
            }
            if k == "config" {
                self.apply_file(Path::new(v))?;
                continue;
            }
            self.set(k, v).map_err(|msg| SettingError {
                source: "mount option".into(),
                key: normalize(k),
                msg,
            })?;
        }
        Ok(())
    }

    pub fn flush_interval(&self) -> Duration {
        Duration::from_millis(self.flush_interval_ms.max(1))
    }

    /// How long the kernel may cache attributes and entries (present or absent) of a mount
    /// over a lower that is a local file system (`local`: one that only this machine
    /// changes) or not: the setting, or for `auto`, `LOCAL_ATTR_TIMEOUT` over a local one
    /// (while mounted, LOWER changes only through the mount, so nothing the kernel caches
    /// goes stale: a tree looked over again, as `git status`, `make` or `ls -lR` do, costs
    /// no round trip per entry), and `SHARED_ATTR_TIMEOUT` over any other (a network or
    /// FUSE file system, which other machines may change).
    pub fn attr_timeout_for(&self, local: bool) -> Duration {
        Duration::from_secs_f64(self.attr_timeout.unwrap_or(if local {
            LOCAL_ATTR_TIMEOUT
        } else {
            SHARED_ATTR_TIMEOUT
        }))
    }
}

/// `attr_timeout = auto` over a local file system, in seconds (changes made to LOWER behind
/// the mount's back, which are not supported, show within a minute).
pub const LOCAL_ATTR_TIMEOUT: f64 = 60.0;
/// `attr_timeout = auto` over a network or FUSE file system, in seconds.
pub const SHARED_ATTR_TIMEOUT: f64 = 1.0;

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` (the default) caches long over a local lower and briefly over a shared one;
    /// a number is taken as given over both; the example configuration's value parses.
    #[test]
    fn the_attribute_timeout_is_long_over_local_lowers_unless_set() {
        let mut s = Settings::default();
        assert_eq!(s.attr_timeout, None);
        assert_eq!(s.attr_timeout_for(true), Duration::from_secs(60));
        assert_eq!(s.attr_timeout_for(false), Duration::from_secs(1));
        s.set("attr_timeout", "0.5").unwrap();
        assert_eq!(s.attr_timeout_for(true), Duration::from_millis(500));
        assert_eq!(s.attr_timeout_for(false), Duration::from_millis(500));
        s.set("attr_timeout", "auto").unwrap();
        assert_eq!(s.attr_timeout, None);
        assert!(s.set("attr_timeout", "forever").is_err());
        let example = include_str!("../contrib/pmstack.toml");
        let mut e = Settings::default();
        e.apply_toml(example, "contrib/pmstack.toml").unwrap();
        assert_eq!(e.attr_timeout, None);
    }

    #[test]
    fn toml_sets_every_key() {
        let mut s = Settings::default();
        s.apply_toml(
            r#"
lower = "/srv/data"
mountpoint = "/mnt/data"
mode = "adaptive"
pm = "/dev/dax0.0"
pm_size = "1G"
flush_interval_ms = 1000
low_watermark = 0.3
throttle_share = 0.5
sensitivity = 4
attr_timeout = 2.5
cache = "writeback"
kernel_passthrough = false
threads = 4
log_level = "info"
log_target = "syslog"
metrics_addr = "127.0.0.1:9464"
allow_other = true
default_permissions = true
ro = false
noatime = true
nodev = true
nosuid = true
noexec = true
"#,
            "t",
        )
        .unwrap();
        assert_eq!(s.lower.as_deref(), Some(Path::new("/srv/data")));
        assert_eq!(s.mode, Mode::Adaptive);
        assert_eq!(s.pm_size, 1 << 30);
        assert_eq!(s.flush_interval_ms, 1000);
        assert_eq!(s.low_watermark, 0.3);
        assert_eq!(s.throttle_share, 0.5);
        assert_eq!(s.sensitivity, 4);
        assert_eq!(s.attr_timeout, Some(2.5));
        assert_eq!(s.cache, CacheMode::Writeback);
        assert!(!s.kernel_passthrough);
        assert_eq!(s.threads, 4);
        assert_eq!(s.log_level, "info");
        assert_eq!(s.log_target, LogTarget::Syslog);
        assert_eq!(s.metrics_addr.as_deref(), Some("127.0.0.1:9464"));
        assert!(s.allow_other && s.default_permissions && !s.ro && s.noatime);
        assert!(s.nodev && s.nosuid && s.noexec);
        // Every key in KEYS was exercised above.
        for (k, _) in KEYS {
            assert!(
                [
                    "lower",
                    "mountpoint",
                    "mode",
                    "pm",
                    "pm_size",
                    "flush_interval_ms",
                    "low_watermark",
                    "throttle_share",
                    "sensitivity",
                    "attr_timeout",
                    "cache",
                    "kernel_passthrough",
                    "threads",
                    "log_level",
                    "log_target",
                    "metrics_addr",
                    "allow_other",
                    "default_permissions",
                    "ro",
                    "noatime",
                    "nodev",
                    "nosuid",
                    "noexec"
                ]
                .contains(k),
                "{k} untested"
            );
        }
    }

    #[test]
    fn errors_name_the_key_and_the_allowed_values() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "mode = \"fast\"",
                "mode",
                "allowed: sync, strict, adaptive, passthrough",
            ),
            (
                "pm_size = \"12Q\"",
                "pm_size",
                "allowed: a size such as 256M",
            ),
            ("pm_size = \"4K\"", "pm_size", "at least 256K"),
            (
                "flush_interval_ms = 0",
                "flush_interval_ms",
                "from 1 to 86400000",
            ),
            (
                "flush_interval_ms = -5",
                "flush_interval_ms",
                "from 1 to 86400000",
            ),
            ("low_watermark = 1.5", "low_watermark", "from 0 to 1"),
            ("throttle_share = \"half\"", "throttle_share", "from 0 to 1"),
            ("sensitivity = 0", "sensitivity", "from 1 to 1000000"),
            ("attr_timeout = -1", "attr_timeout", "from 0 to 86400"),
            ("cache = \"none\"", "cache", "writethrough, writeback"),
            (
                "kernel_passthrough = \"maybe\"",
                "kernel_passthrough",
                "true, false",
            ),
            ("threads = 0", "threads", "from 1 to 64"),
            ("threads = 1000", "threads", "from 1 to 64"),
            (
                "log_level = \"pmstack=[\"",
                "log_level",
                "error, warn, info",
            ),
            (
                "log_target = \"file\"",
                "log_target",
                "stderr, journald, syslog",
            ),
            (
                "metrics_addr = \"localhost\"",
                "metrics_addr",
                "127.0.0.1:9464",
            ),
            ("allow_other = 3", "allow_other", "true, false"),
            ("pm = \"\"", "pm", "a path"),
            ("lower = \"\"", "lower", "a path"),
            ("mode = [\"sync\"]", "mode", "a array is not accepted"),
            (
                "bogus = 1",
                "bogus",
                "unknown key (known keys: lower, mountpoint, mode",
            ),
            ("[metrics]\naddr = 1", "metrics", "unknown key"),
        ];
        for (text, key, want) in cases {
            let mut s = Settings::default();
            let e = s.apply_toml(text, "config x.toml").unwrap_err();
            let msg = e.to_string();
            assert_eq!(e.key, *key, "{text}: {msg}");
            assert!(
                msg.starts_with(&format!("config x.toml: key '{key}': ")),
                "{text}: {msg}"
            );
            assert!(msg.contains(want), "{text}: {msg} lacks {want}");
            assert!(!msg.contains('\n'), "one line: {msg}");
            // Nothing applied from a bad file's bad key.
            assert_eq!(s, Settings::default(), "{text}");
        }
        let e = Settings::default()
            .apply_toml("mode = ", "config y.toml")
            .unwrap_err();
        assert!(
            e.to_string().starts_with("config y.toml: not valid TOML"),
            "{e}"
        );
    }

    #[test]
    fn mount_options_like_fstab() {
        let mut s = Settings::default();
        s.apply_options(
            "rw,defaults,nofail,_netdev,x-systemd.requires=pm.service,comment=x,pm=/dev/shm/r.pm,mode=strict,pm-size=64M,allow_other,noatime,flush_interval_ms=200",
        )
        .unwrap();
        assert_eq!(s.pm.as_deref(), Some(Path::new("/dev/shm/r.pm")));
        assert_eq!(s.mode, Mode::Strict);
        assert_eq!(s.pm_size, 64 << 20);
        assert!(s.allow_other && s.noatime && !s.ro);
        assert_eq!(s.flush_interval_ms, 200);
        let e = Settings::default()
            .apply_options("mode=sync,sometimes")
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "mount option: key 'sometimes': unknown key (known keys: {})",
                known_keys()
            )
        );
        let e = Settings::default().apply_options("ro=perhaps").unwrap_err();
        assert_eq!(
            e.to_string(),
            "mount option: key 'ro': invalid value 'perhaps' (allowed: true, false)"
        );
        let e = Settings::default()
            .apply_options("config=/nonexistent/pmstack.toml")
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with("config /nonexistent/pmstack.toml: cannot read it"),
            "{e}"
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2k"), Ok(2048));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert!(parse_size("99999999999999G").is_err());
        assert!(parse_size("G").is_err());
    }
}
