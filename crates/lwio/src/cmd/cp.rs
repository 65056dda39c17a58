//! `lwio cp [-r] SRC DST`: local → remote, remote → local, remote → remote.
//!
//! Data moves with LWIO READ/WRITE over RDMA; the side channel only stats,
//! lists, creates directories, opens/creates files, renames and removes.
//!
//! **No partial destination ever has the final name**: each file is written
//! to `.NAME.lwio-part-XXXXXXXX` in the destination directory and renamed
//! over the final name only when complete (remote rename over the side
//! channel; local `rename(2)`). On an error or SIGINT/SIGTERM the temporary
//! file is removed (if the server went away it cannot be removed there,
//! but it still does not look complete).

use std::collections::HashMap;
use std::fs::OpenOptions as StdOpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::{connect_data, ctx, pump, random_suffix, LocalReader, ReadAt, RemoteReader};
use crate::cli::{ClientArgs, CpArgs};
use lwio_client::url::LwioUrl;
use lwio_client::{Client, OpenOptions};
use lwio_side::FileKind;

/// One end of a copy.
#[derive(Debug, Clone)]
enum Loc {
    Local(PathBuf),
    Remote(LwioUrl),
}

impl std::fmt::Display for Loc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Loc::Local(p) => write!(f, "{}", p.display()),
            Loc::Remote(u) => write!(f, "{u}"),
        }
    }
}

impl Loc {
    fn parse(s: &str) -> anyhow::Result<Loc> {
        if s.starts_with("lwio://") {
            let u = LwioUrl::parse(s)?;
            u.require_export()?;
            Ok(Loc::Remote(u))
        } else if s.is_empty() {
            anyhow::bail!("empty path")
        } else {
            Ok(Loc::Local(PathBuf::from(s)))
        }
    }

    fn join(&self, name: &str) -> Loc {
        match self {
            Loc::Local(p) => Loc::Local(p.join(name)),
            Loc::Remote(u) => {
                let mut u = u.clone();
                u.path = if u.path.is_empty() {
                    name.to_string()
                } else {
                    format!("{}/{name}", u.path.trim_end_matches('/'))
                };
                Loc::Remote(u)
            }
        }
    }

    /// The last path component (the export name for an export's root).
    fn base_name(&self) -> anyhow::Result<String> {
        match self {
            Loc::Local(p) => {
                let canon;
                let p = if p.file_name().is_none() {
                    canon = std::fs::canonicalize(p)
                        .map_err(|e| anyhow::anyhow!("{}: {}", p.display(), io_msg(&e)))?;
                    &canon
                } else {
                    p
                };
                p.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .ok_or_else(|| anyhow::anyhow!("{}: has no file name", p.display()))
            }
            Loc::Remote(u) => Ok(match u.path.rsplit('/').find(|s| !s.is_empty()) {
                Some(s) => s.to_string(),
                None => u.export.clone().unwrap_or_default(),
            }),
        }
    }
}

fn io_msg(e: &std::io::Error) -> String {
    lwio_side::Error::from_io(e, "")
        .message
        .trim_start_matches(": ")
        .to_string()
}

/// What is at a location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Missing,
    File(u64),
    Dir,
    Other,
}

/// Connected clients by server (`host:port`).
struct Clients<'a> {
    args: &'a ClientArgs,
    by_server: HashMap<String, Client>,
}

impl Clients<'_> {
    fn get(&mut self, u: &LwioUrl) -> anyhow::Result<Client> {
        let key = u.authority();
        if let Some(c) = self.by_server.get(&key) {
            return Ok(c.clone());
        }
        let c = connect_data(u, self.args, super::bulk_options())?;
        self.by_server.insert(key, c.clone());
        Ok(c)
    }

    fn kind(&mut self, l: &Loc) -> anyhow::Result<Kind> {
        match l {
            Loc::Local(p) => match std::fs::metadata(p) {
                Ok(m) if m.is_dir() => Ok(Kind::Dir),
                Ok(m) if m.is_file() => Ok(Kind::File(m.len())),
                Ok(_) => Ok(Kind::Other),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Kind::Missing),
                Err(e) => anyhow::bail!("{}: {}", p.display(), io_msg(&e)),
            },
            Loc::Remote(u) => {
                let c = self.get(u)?;
                let export = u.require_export()?.to_string();
                // Keep the side channel's own error code: "no such file"
                // means Missing, "no such export" is an error.
                match c.side(|s| Ok(s.stat(&export, &u.path))) {
                    Ok(Ok(a)) => Ok(match a.kind {
                        FileKind::Dir => Kind::Dir,
                        FileKind::File => Kind::File(a.size),
                        _ => Kind::Other,
                    }),
                    Ok(Err(e)) if e.code == lwio_side::ErrorCode::NotFound => Ok(Kind::Missing),
                    Ok(Err(e)) => Err(ctx(u, e.into())),
                    Err(e) => Err(ctx(u, e)),
                }
            }
        }
    }

    /// Names in a directory with their kinds (symlinks resolved).
    fn list(&mut self, l: &Loc) -> anyhow::Result<Vec<(String, Kind)>> {
        let mut out = Vec::new();
        match l {
            Loc::Local(p) => {
                let rd = std::fs::read_dir(p)
                    .map_err(|e| anyhow::anyhow!("{}: {}", p.display(), io_msg(&e)))?;
                for e in rd {
                    let e = e.map_err(|e| anyhow::anyhow!("{}: {}", p.display(), io_msg(&e)))?;
                    let name = e.file_name().to_string_lossy().into_owned();
                    let child = l.join(&name);
                    let is_link = e.file_type().map(|t| t.is_symlink()).unwrap_or(false);
                    let k = self.kind(&child)?;
                    if is_link && k == Kind::Dir {
                        warn_skip(&child, "a symbolic link to a directory");
                        continue;
                    }
                    out.push((name, k));
                }
            }
            Loc::Remote(u) => {
                let c = self.get(u)?;
                let export = u.require_export()?.to_string();
                let entries = c
                    .side(|s| s.list_dir(&export, &u.path))
                    .map_err(|e| ctx(u, e))?;
                for e in entries {
                    let k = match e.attr.kind {
                        FileKind::Dir => Kind::Dir,
                        FileKind::File => Kind::File(e.attr.size),
                        FileKind::Symlink => match self.kind(&l.join(&e.name))? {
                            Kind::Dir => {
                                warn_skip(&l.join(&e.name), "a symbolic link to a directory");
                                continue;
                            }
                            k => k,
                        },
                        FileKind::Other
                        | FileKind::Fifo
                        | FileKind::Socket
                        | FileKind::CharDev
                        | FileKind::BlockDev => Kind::Other,
                    };
                    out.push((e.name, k));
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

/// A listed name is joined to the destination only if it is one path
/// component: a server's `../x` would climb out of it and an absolute name
/// replace it (the client library refuses such listings already; this is
/// the second line).
fn one_component(dir: &Loc, name: &str) -> anyhow::Result<()> {
    use std::path::Component;
    let mut c = Path::new(name).components();
    let one = matches!((c.next(), c.next()), (Some(Component::Normal(n)), None) if *n == *name);
    if !one || name.contains(['/', '\0']) {
        anyhow::bail!("{dir}: server listed an invalid entry name {name:?}");
    }
    Ok(())
}

fn warn_skip(l: &Loc, why: &str) {
    eprintln!("lwio: warning: skipping {l}: {why}");
}

/// The work, planned before any byte moves (so the progress bar knows the
/// total and obvious errors come first).
enum Step {
    Mkdir(Loc),
    Copy { src: Loc, dst: Loc, size: u64 },
}

pub fn run(a: CpArgs) -> anyhow::Result<()> {
    let src = Loc::parse(&a.src)?;
    let dst = Loc::parse(&a.dst)?;
    if let (Loc::Local(_), Loc::Local(_)) = (&src, &dst) {
        anyhow::bail!(
            "both {} and {} are local paths: one of them must be an lwio:// URL (use cp(1) for local copies)",
            a.src,
            a.dst
        );
    }
    super::catch_interrupts();
    let mut clients = Clients {
        args: &a.client,
        by_server: HashMap::new(),
    };
    let src_kind = clients.kind(&src)?;
    let dst_kind = clients.kind(&dst)?;
    let dst_is_dir = dst_kind == Kind::Dir || a.dst.ends_with('/');
    let mut steps = Vec::new();
    match src_kind {
        Kind::Missing => anyhow::bail!("{src}: No such file or directory"),
        Kind::Other => anyhow::bail!("{src}: not a regular file or directory"),
        Kind::File(size) => {
            let dst = if dst_is_dir {
                dst.join(&src.base_name()?)
            } else {
                dst
            };
            if clients.kind(&dst)? == Kind::Dir {
                anyhow::bail!("{dst}: is a directory");
            }
            steps.push(Step::Copy { src, dst, size });
        }
        Kind::Dir => {
            if !a.recursive {
                anyhow::bail!("{src}: is a directory (use -r to copy directories)");
            }
            let root = if dst_kind == Kind::Dir {
                dst.join(&src.base_name()?)
            } else if let Kind::File(_) = dst_kind {
                anyhow::bail!("{dst}: cannot overwrite a file with directory {src}");
            } else {
                dst
            };
            plan_tree(&mut clients, &src, &root, &mut steps)?;
        }
    }
    let total: u64 = steps
        .iter()
        .map(|s| match s {
            Step::Copy { size, .. } => *size,
            Step::Mkdir(_) => 0,
        })
        .sum();
    let pb = super::byte_bar(total, "");
    let r = (|| {
        for s in &steps {
            match s {
                Step::Mkdir(d) => mkdir(&mut clients, d)?,
                Step::Copy { src, dst, .. } => {
                    pb.set_message(src.base_name().unwrap_or_default());
                    copy_file(&mut clients, src, dst, &pb)?;
                }
            }
        }
        Ok(())
    })();
    pb.finish_and_clear();
    r
}

fn plan_tree(
    clients: &mut Clients<'_>,
    src: &Loc,
    dst: &Loc,
    steps: &mut Vec<Step>,
) -> anyhow::Result<()> {
    let exists = dir_exists(clients, dst)?;
    if !exists {
        steps.push(Step::Mkdir(dst.clone()));
    }
    plan_children(clients, src, dst, exists, steps)
}

fn dir_exists(clients: &mut Clients<'_>, d: &Loc) -> anyhow::Result<bool> {
    match clients.kind(d)? {
        Kind::Dir => Ok(true),
        Kind::Missing => Ok(false),
        _ => anyhow::bail!("{d}: exists and is not a directory"),
    }
}

fn plan_children(
    clients: &mut Clients<'_>,
    src: &Loc,
    dst: &Loc,
    dst_exists: bool,
    steps: &mut Vec<Step>,
) -> anyhow::Result<()> {
    for (name, kind) in clients.list(src)? {
        one_component(src, &name)?;
        let (s, d) = (src.join(&name), dst.join(&name));
        match kind {
            Kind::File(size) => steps.push(Step::Copy {
                src: s,
                dst: d,
                size,
            }),
            Kind::Dir => {
                // Only stat destinations that can exist.
                let exists = dst_exists && dir_exists(clients, &d)?;
                if !exists {
                    steps.push(Step::Mkdir(d.clone()));
                }
                plan_children(clients, &s, &d, exists, steps)?;
            }
            Kind::Missing => {}
            Kind::Other => warn_skip(&s, "not a regular file or directory"),
        }
    }
    Ok(())
}

fn mkdir(clients: &mut Clients<'_>, d: &Loc) -> anyhow::Result<()> {
    match d {
        Loc::Local(p) => match std::fs::create_dir(p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && p.is_dir() => Ok(()),
            Err(e) => anyhow::bail!("{}: {}", p.display(), io_msg(&e)),
        },
        Loc::Remote(u) => {
            let c = clients.get(u)?;
            let export = u.require_export()?.to_string();
            c.side(|s| s.mkdir(&export, &u.path, 0o755, true))
                .map_err(|e| ctx(u, e))
        }
    }
}

fn no_dir(dst: &Loc) -> anyhow::Error {
    anyhow::anyhow!("{dst}: the destination directory does not exist")
}

/// The temporary sibling of `dst`: `.NAME.lwio-part-XXXXXXXX`.
fn temp_name(name: &str) -> String {
    format!(".{name}.lwio-part-{}", random_suffix())
}

/// Where data is written.
enum Sink<'a> {
    Local {
        file: std::fs::File,
        temp: PathBuf,
        final_path: &'a Path,
    },
    Remote {
        file: Option<lwio_client::File>,
        client: Client,
        url: &'a LwioUrl,
        export: String,
        temp: String,
    },
    /// A memory object (docs/memory-objects.md): written in place (it
    /// cannot be created, renamed over or resized).
    Memory {
        file: Option<lwio_client::File>,
        url: &'a LwioUrl,
    },
}

/// Whether a path of an export names a memory object
/// (`.lwio-mem/NAME`).
fn is_memory_object(path: &str) -> bool {
    path.split('/')
        .find(|c| !c.is_empty() && *c != ".")
        .is_some_and(|c| c == ".lwio-mem")
}

impl Sink<'_> {
    fn write_at(&self, buf: &[u8], off: u64) -> anyhow::Result<()> {
        match self {
            Sink::Local { file, temp, .. } => file
                .write_all_at(buf, off)
                .map_err(|e| anyhow::anyhow!("{}: {}", temp.display(), io_msg(&e))),
            Sink::Remote { file, url, .. } | Sink::Memory { file, url } => {
                let f = file.as_ref().expect("open until finished");
                f.write_at(buf, off).map(|_| ()).map_err(|e| ctx(url, e))
            }
        }
    }

    /// Close and rename over the final name.
    fn commit(&mut self) -> anyhow::Result<()> {
        match self {
            Sink::Local {
                file,
                temp,
                final_path,
            } => {
                file.sync_data()
                    .map_err(|e| anyhow::anyhow!("{}: {}", temp.display(), io_msg(&e)))?;
                std::fs::rename(&*temp, &**final_path).map_err(|e| {
                    anyhow::anyhow!(
                        "renaming {} to {}: {}",
                        temp.display(),
                        final_path.display(),
                        io_msg(&e)
                    )
                })
            }
            Sink::Remote {
                file,
                client,
                url,
                export,
                temp,
            } => {
                if let Some(f) = file.take() {
                    f.close().map_err(|e| ctx(&**url, e))?;
                }
                client
                    .side(|s| s.rename(export, temp, &url.path, true))
                    .map_err(|e| ctx(&**url, e))
            }
            Sink::Memory { file, url } => match file.take() {
                Some(f) => f.close().map_err(|e| ctx(&**url, e)),
                None => Ok(()),
            },
        }
    }

    /// Remove the temporary file (best effort); a note when it had to stay.
    fn abort(&mut self) -> Option<String> {
        match self {
            Sink::Local { temp, .. } => std::fs::remove_file(&*temp)
                .err()
                .map(|e| format!("could not remove {}: {}", temp.display(), io_msg(&e))),
            Sink::Remote {
                file,
                client,
                export,
                temp,
                ..
            } => {
                drop(file.take());
                client
                    .side(|s| s.remove(export, temp))
                    .err()
                    .map(|_| format!("the partial copy {export}/{temp} stays on the server"))
            }
            Sink::Memory { file, url } => {
                drop(file.take());
                Some(format!("{url} may be partly written"))
            }
        }
    }
}

fn copy_file(
    clients: &mut Clients<'_>,
    src: &Loc,
    dst: &Loc,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<()> {
    // Open the source.
    let src_local;
    let src_remote;
    let mut src_handle = None;
    let reader: Box<dyn ReadAt + '_> = match src {
        Loc::Local(p) => {
            src_local = std::fs::File::open(p)
                .map_err(|e| anyhow::anyhow!("{}: {}", p.display(), io_msg(&e)))?;
            Box::new(LocalReader {
                file: &src_local,
                name: p.display().to_string(),
            })
        }
        Loc::Remote(u) => {
            let c = clients.get(u)?;
            let export = u.require_export()?;
            src_remote = c
                .open(&format!("{export}/{}", u.path), &OpenOptions::read_only())
                .map_err(|e| ctx(u, e))?;
            // The server copies files, not memory objects.
            if !is_memory_object(&u.path) {
                src_handle = Some((u.authority(), src_remote.handle()));
            }
            Box::new(RemoteReader {
                file: &src_remote,
                name: u.to_string(),
            })
        }
    };
    let name = dst.base_name()?;
    let temp = temp_name(&name);
    let mut sink = match dst {
        Loc::Local(p) => {
            let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
            let temp = dir.map_or_else(|| PathBuf::from(&temp), |d| d.join(&temp));
            let mode = match src {
                Loc::Local(s) => std::fs::metadata(s).map_or(0o644, |m| m.permissions().mode()),
                Loc::Remote(_) => 0o644,
            } & 0o777;
            let file = StdOpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .open(&temp)
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => no_dir(dst),
                    _ => anyhow::anyhow!("{}: {}", p.display(), io_msg(&e)),
                })?;
            Sink::Local {
                file,
                temp,
                final_path: p,
            }
        }
        Loc::Remote(u) if is_memory_object(&u.path) => {
            let client = clients.get(u)?;
            let export = u.require_export()?;
            let file = client
                .open(&format!("{export}/{}", u.path), &OpenOptions::read_write())
                .map_err(|e| ctx(u, e))?;
            Sink::Memory {
                file: Some(file),
                url: u,
            }
        }
        Loc::Remote(u) => {
            let client = clients.get(u)?;
            let export = u.require_export()?.to_string();
            let temp = match u.path.rsplit_once('/') {
                Some((dir, _)) => format!("{dir}/{temp}"),
                None => temp,
            };
            let file = client
                .open(
                    &format!("{export}/{temp}"),
                    &OpenOptions::read_write().create(true).exclusive(true),
                )
                .map_err(|e| match e {
                    lwio_client::Error::NotFound(_) => no_dir(dst),
                    e => ctx(u, e),
                })?;
            Sink::Remote {
                file: Some(file),
                client,
                url: u,
                export,
                temp,
            }
        }
    };
    // Both ends on one server: it copies (copy_file_range), and no byte
    // crosses to this client.
    let on_server = match (&src_handle, &sink) {
        (
            Some((auth, sh)),
            Sink::Remote {
                file: Some(df),
                client,
                url,
                ..
            },
        ) if *auth == url.authority() => Some((client.clone(), *sh, df.handle(), *url)),
        _ => None,
    };
    let r = match on_server {
        Some((client, sh, dh, url)) => (|| {
            let mut off = 0u64;
            loop {
                let n = client
                    .side(|s| s.copy_range(sh, off, dh, off, lwio_side::codec::COPY_RANGE_MAX))
                    .map_err(|e| ctx(url, e))?;
                if n == 0 {
                    break;
                }
                off += n;
                pb.inc(n);
            }
            tracing::info!(
                bytes = off,
                "copied on the server: no data through this client"
            );
            Ok(())
        })(),
        None => pump(&*reader, pb, |buf, off| {
            sink.write_at(buf, off).map(|()| true)
        })
        .map(|_| ()),
    }
    .and_then(|_| sink.commit());
    if let Err(e) = r {
        return Err(match sink.abort() {
            Some(note) => anyhow::anyhow!("{e} ({note})"),
            None => e,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_one_component_names_are_joined() {
        let dir = Loc::Local(PathBuf::from("/tmp/dst"));
        for good in ["a", "a.b", "..a", "a..", ".hidden", "a b", "a\\b"] {
            one_component(&dir, good).unwrap();
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "/etc/passwd",
            "a/b",
            "a/",
            "./a",
            "a\0b",
        ] {
            let e = one_component(&dir, bad).unwrap_err().to_string();
            assert_eq!(
                e,
                format!("/tmp/dst: server listed an invalid entry name {bad:?}")
            );
        }
    }
}
