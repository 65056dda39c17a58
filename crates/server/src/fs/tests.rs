//! Path confinement tests, run for both resolvers where available.

use super::*;
use std::os::unix::fs::symlink;

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    outside: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("export");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(root.join("sub/deeper")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(root.join("sub/file.txt"), b"hello").unwrap();
    std::fs::write(outside.join("secret"), b"secret").unwrap();
    Fixture {
        _dir: dir,
        root,
        outside,
    }
}

fn modes() -> Vec<ResolveMode> {
    let mut v = vec![ResolveMode::Fallback];
    if openat2_available() {
        v.push(ResolveMode::Openat2);
    } else {
        eprintln!("openat2 unavailable: testing the fallback resolver only");
    }
    v
}

fn export(f: &Fixture, mode: ResolveMode) -> Export {
    let spec = ExportSpec {
        name: "data".into(),
        path: f.root.clone(),
        read_only: false,
        allow_hardlinks: false,
        ..Default::default()
    };
    Export::open(&spec, mode).unwrap()
}

const RO: OpenOptions = OpenOptions::READ;

#[test]
fn split_rejects_dotdot_and_absolute() {
    assert_eq!(split_rel_path("a//b/./c/").unwrap(), vec!["a", "b", "c"]);
    assert!(split_rel_path("").unwrap().is_empty());
    for bad in ["..", "a/../b", "a/..", "../x"] {
        assert_eq!(
            split_rel_path(bad).unwrap_err().code,
            ErrorCode::OutsideExport,
            "{bad}"
        );
    }
    assert_eq!(
        split_rel_path("/etc/passwd").unwrap_err().code,
        ErrorCode::OutsideExport
    );
    assert_eq!(
        split_rel_path("a\0b").unwrap_err().code,
        ErrorCode::BadRequest
    );
    assert_eq!(
        split_rel_path(&"x".repeat(256)).unwrap_err().code,
        ErrorCode::NameTooLong
    );
    assert_eq!(
        split_rel_path(&"a/".repeat(3000)).unwrap_err().code,
        ErrorCode::NameTooLong
    );
}

#[test]
fn export_specs() {
    let s: ExportSpec = "data=/srv/data".parse().unwrap();
    assert_eq!(s.name, "data");
    assert_eq!(s.path, PathBuf::from("/srv/data"));
    assert!("data".parse::<ExportSpec>().is_err());
    assert!("=/x".parse::<ExportSpec>().is_err());
    assert!("a/b=/x".parse::<ExportSpec>().is_err());
    assert!("..=/x".parse::<ExportSpec>().is_err());
    assert!("d=".parse::<ExportSpec>().is_err());
    assert_eq!(
        "with=equals=/x".parse::<ExportSpec>().unwrap().path,
        PathBuf::from("equals=/x")
    );
}

#[test]
fn missing_root_and_duplicates() {
    let spec: ExportSpec = "d=/nonexistent/lwio-test".parse().unwrap();
    let e = Exports::open(&[spec], ResolveMode::Auto).unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound);
    let f = fixture();
    let s = ExportSpec {
        name: "d".into(),
        path: f.root.clone(),
        read_only: false,
        allow_hardlinks: false,
        ..Default::default()
    };
    let e = Exports::open(&[s.clone(), s], ResolveMode::Auto).unwrap_err();
    assert!(e.message.contains("twice"));
    let ex = Exports::open(&[], ResolveMode::Auto).unwrap();
    assert_eq!(ex.get("nope").unwrap_err().code, ErrorCode::NoSuchExport);
}

#[test]
fn stat_list_open_inside() {
    let f = fixture();
    for m in modes() {
        let e = export(&f, m);
        assert_eq!(e.resolve_mode(), m);
        let a = e.stat("sub/file.txt").unwrap();
        assert_eq!(a.kind, FileKind::File);
        assert_eq!(a.size, 5);
        assert_eq!(e.stat("").unwrap().kind, FileKind::Dir);
        let l = e.list("sub").unwrap();
        let names: Vec<_> = l.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, vec!["deeper", "file.txt"]);
        let o = e.open_file("sub/file.txt", &RO, 0).unwrap();
        assert_eq!(o.size, 5);
        assert_eq!(e.stat("nope").unwrap_err().code, ErrorCode::NotFound);
        assert_eq!(
            e.list("sub/file.txt").unwrap_err().code,
            ErrorCode::NotADirectory
        );
        assert_eq!(
            e.open_file("sub", &RO, 0).unwrap_err().code,
            ErrorCode::IsADirectory
        );
    }
}

#[test]
fn symlink_pointing_outside_is_refused() {
    let f = fixture();
    symlink(&f.outside, f.root.join("abs_out")).unwrap();
    symlink("../outside", f.root.join("rel_out")).unwrap();
    symlink("../../outside/secret", f.root.join("sub/file_out")).unwrap();
    for m in modes() {
        let e = export(&f, m);
        for p in [
            "abs_out/secret",
            "rel_out/secret",
            "sub/file_out",
            "abs_out",
            "rel_out",
        ] {
            let err = e.stat(p).unwrap_err();
            assert_eq!(err.code, ErrorCode::OutsideExport, "{m:?} {p}: {err}");
            let err = e.open_file(p, &RO, 0).unwrap_err();
            assert_eq!(err.code, ErrorCode::OutsideExport, "{m:?} {p}: {err}");
        }
        // Creating through a link that leaves is refused too.
        let w = OpenOptions {
            write: true,
            create: true,
            ..RO
        };
        assert_eq!(
            e.open_file("rel_out/new", &w, 0o644).unwrap_err().code,
            ErrorCode::OutsideExport
        );
        assert_eq!(
            e.mkdir("abs_out/newdir", 0o755, false).unwrap_err().code,
            ErrorCode::OutsideExport
        );
        assert!(!f.outside.join("new").exists());
        assert!(!f.outside.join("newdir").exists());
        // Listing shows links as links and removing one removes only the link.
        let l = e.list("").unwrap();
        assert!(l
            .iter()
            .any(|d| d.name == "abs_out" && d.attr.kind == FileKind::Symlink));
    }
    let e = export(&f, ResolveMode::Auto);
    e.remove("abs_out").unwrap();
    assert!(f.outside.join("secret").exists());
}

#[test]
fn symlink_inside_policy() {
    let f = fixture();
    symlink("sub", f.root.join("alias")).unwrap();
    symlink("file.txt", f.root.join("sub/link.txt")).unwrap();
    if openat2_available() {
        let e = export(&f, ResolveMode::Openat2);
        assert_eq!(e.stat("alias/file.txt").unwrap().size, 5);
        assert_eq!(e.stat("sub/link.txt").unwrap().size, 5);
        assert_eq!(e.open_file("alias/link.txt", &RO, 0).unwrap().size, 5);
    }
    // Fallback: no symlink is followed, with a clear message.
    let e = export(&f, ResolveMode::Fallback);
    for p in ["alias/file.txt", "sub/link.txt", "alias"] {
        let err = e.stat(p).unwrap_err();
        assert_eq!(err.code, ErrorCode::OutsideExport, "{p}: {err}");
        assert!(err.message.contains("symbolic link"), "{err}");
    }
}

#[test]
fn symlink_swapped_in() {
    let f = fixture();
    for m in modes() {
        let e = export(&f, m);
        std::fs::create_dir_all(f.root.join("swap")).unwrap();
        std::fs::write(f.root.join("swap/secret"), b"inside").unwrap();
        assert_eq!(e.stat("swap/secret").unwrap().size, 6);
        // An attacker with write access to the export replaces the directory
        // by a symlink to the outside between two requests.
        std::fs::remove_dir_all(f.root.join("swap")).unwrap();
        symlink(&f.outside, f.root.join("swap")).unwrap();
        let err = e.open_file("swap/secret", &RO, 0).unwrap_err();
        assert_eq!(err.code, ErrorCode::OutsideExport, "{m:?}: {err}");
        assert_eq!(e.list("swap").unwrap_err().code, ErrorCode::OutsideExport);
        std::fs::remove_file(f.root.join("swap")).unwrap();
    }
}

#[test]
fn hard_links_are_refused_unless_allowed() {
    // A hard link inside the export may name a file outside it: refused by
    // default (link count from fstat of the opened fd), allowed per export.
    let f = fixture();
    if std::fs::hard_link(f.outside.join("secret"), f.root.join("hl")).is_err() {
        crate::io_phase::testkit::skip("cannot create hard links here");
        return;
    }
    let rw_trunc = OpenOptions {
        write: true,
        truncate: true,
        ..RO
    };
    for m in modes() {
        let e = export(&f, m);
        // stat still works (it does not expose contents).
        assert_eq!(e.stat("hl").unwrap().size, 6);
        for o in [RO, rw_trunc] {
            let err = e.open_file("hl", &o, 0).unwrap_err();
            assert_eq!(err.code, ErrorCode::PermissionDenied, "{err}");
            assert!(
                err.message.contains("hl is hard-linked (2 links)")
                    && err.message.contains("allow_hardlinks"),
                "{err}"
            );
        }
        // The refused O_TRUNC open changed nothing.
        assert_eq!(std::fs::read(f.outside.join("secret")).unwrap(), b"secret");
        // A file with one link opens as before.
        assert!(e.open_file("sub/file.txt", &RO, 0).is_ok());

        let spec = ExportSpec {
            name: "data".into(),
            path: f.root.clone(),
            read_only: false,
            allow_hardlinks: true,
            ..Default::default()
        };
        let allowed = Export::open(&spec, m).unwrap();
        let mut of = allowed.open_file("hl", &RO, 0).unwrap();
        assert_eq!(of.size, 6);
        let mut s = String::new();
        std::io::Read::read_to_string(&mut of.file, &mut s).unwrap();
        assert_eq!(s, "secret");
    }
    // Truncation still works where allowed (deferred after the check).
    let spec = ExportSpec {
        name: "data".into(),
        path: f.root.clone(),
        read_only: false,
        allow_hardlinks: true,
        ..Default::default()
    };
    let allowed = Export::open(&spec, ResolveMode::Auto).unwrap();
    assert_eq!(allowed.open_file("hl", &rw_trunc, 0).unwrap().size, 0);
    assert_eq!(std::fs::read(f.outside.join("secret")).unwrap(), b"");
}

#[test]
fn mkdir_remove_rename() {
    let f = fixture();
    for m in modes() {
        let e = export(&f, m);
        e.mkdir("a", 0o755, false).unwrap();
        assert_eq!(
            e.mkdir("a", 0o755, false).unwrap_err().code,
            ErrorCode::Exists
        );
        e.mkdir("a", 0o755, true).unwrap();
        e.mkdir("p/q/r", 0o755, true).unwrap();
        assert_eq!(e.stat("p/q/r").unwrap().kind, FileKind::Dir);
        assert_eq!(
            e.mkdir("x/y", 0o755, false).unwrap_err().code,
            ErrorCode::NotFound
        );
        assert_eq!(
            e.remove("p").unwrap_err().code,
            ErrorCode::DirectoryNotEmpty
        );
        e.rename("p/q/r", "a/r2", false).unwrap();
        assert_eq!(e.stat("a/r2").unwrap().kind, FileKind::Dir);
        std::fs::write(f.root.join("f1"), b"1").unwrap();
        std::fs::write(f.root.join("f2"), b"22").unwrap();
        assert_eq!(
            e.rename("f1", "f2", false).unwrap_err().code,
            ErrorCode::Exists
        );
        e.rename("f1", "f2", true).unwrap();
        assert_eq!(e.stat("f2").unwrap().size, 1);
        assert_eq!(
            e.rename("f2", "../f3", true).unwrap_err().code,
            ErrorCode::OutsideExport
        );
        e.remove("f2").unwrap();
        e.remove("a/r2").unwrap();
        e.remove("a").unwrap();
        e.remove("p/q").unwrap();
        e.remove("p").unwrap();
        assert_eq!(e.remove("p").unwrap_err().code, ErrorCode::NotFound);
        assert_eq!(e.remove("").unwrap_err().code, ErrorCode::BadRequest);
    }
}

#[test]
fn open_rights() {
    let f = fixture();
    let e = export(&f, ResolveMode::Auto);
    let w = OpenOptions {
        write: true,
        create: true,
        ..RO
    };
    let o = e.open_file("new.bin", &w, 0o600).unwrap();
    assert_eq!(o.size, 0);
    let excl = OpenOptions {
        exclusive: true,
        ..w
    };
    assert_eq!(
        e.open_file("new.bin", &excl, 0o600).unwrap_err().code,
        ErrorCode::Exists
    );
    let bad = OpenOptions { create: true, ..RO };
    assert_eq!(
        e.open_file("x", &bad, 0).unwrap_err().code,
        ErrorCode::InvalidArgument
    );
    let none = OpenOptions { read: false, ..RO };
    assert_eq!(
        e.open_file("new.bin", &none, 0).unwrap_err().code,
        ErrorCode::InvalidArgument
    );
    std::fs::write(f.root.join("t"), b"12345").unwrap();
    let tr = OpenOptions {
        write: true,
        truncate: true,
        ..RO
    };
    e.open_file("t", &tr, 0).unwrap();
    assert_eq!(e.stat("t").unwrap().size, 0);

    let spec = ExportSpec {
        name: "ro".into(),
        path: f.root.clone(),
        read_only: true,
        allow_hardlinks: false,
        ..Default::default()
    };
    let ro = Export::open(&spec, ResolveMode::Auto).unwrap();
    assert!(ro.open_file("t", &RO, 0).is_ok());
    assert_eq!(
        ro.open_file("t", &w, 0).unwrap_err().code,
        ErrorCode::ReadOnly
    );
    assert_eq!(
        ro.mkdir("z", 0o755, false).unwrap_err().code,
        ErrorCode::ReadOnly
    );
    assert_eq!(ro.remove("t").unwrap_err().code, ErrorCode::ReadOnly);
    assert_eq!(
        ro.rename("t", "u", false).unwrap_err().code,
        ErrorCode::ReadOnly
    );
}

#[test]
fn fifo_does_not_hang() {
    let f = fixture();
    let p = CString::new(f.root.join("fifo").as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: valid path.
    if unsafe { libc::mkfifo(p.as_ptr(), 0o600) } != 0 {
        return;
    }
    let e = export(&f, ResolveMode::Auto);
    assert_eq!(
        e.open_file("fifo", &RO, 0).unwrap_err().code,
        ErrorCode::InvalidArgument
    );
}

#[test]
fn direct_io_alignment_reported() {
    let f = fixture();
    let e = export(&f, ResolveMode::Auto);
    let o = OpenOptions {
        write: true,
        create: true,
        no_buffering: true,
        write_through: true,
        ..RO
    };
    match e.open_file("direct.bin", &o, 0o600) {
        Ok(of) => {
            assert!(of.direct);
            assert!(of.align.is_power_of_two() && of.align >= 1);
        }
        Err(err) => assert_eq!(err.code, ErrorCode::Unsupported, "{err}"),
    }
}

#[test]
fn file_system_ops_never_leave_the_export_or_follow_a_final_link() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let f = fixture();
    symlink(f.outside.join("secret"), f.root.join("out")).unwrap();
    symlink("../outside", f.root.join("updir")).unwrap();
    let mode_of = |p: &std::path::Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
    let secret_mode = mode_of(&f.outside.join("secret"));
    let secret_mtime = std::fs::metadata(f.outside.join("secret")).unwrap().mtime();
    for m in modes() {
        let e = export(&f, m);
        // chmod/truncate of a final symlink that points outside: refused,
        // and the target is untouched.
        let chmod = SetAttr {
            mode: Some(0o777),
            ..SetAttr::default()
        };
        assert_eq!(
            e.set_attr("out", &chmod).unwrap_err().code,
            ErrorCode::Unsupported
        );
        let trunc = SetAttr {
            size: Some(0),
            ..SetAttr::default()
        };
        assert_eq!(
            e.set_attr("out", &trunc).unwrap_err().code,
            ErrorCode::InvalidArgument
        );
        // Times and owner of the link itself change; never the target's.
        let times = SetAttr {
            mtime: Some(SetTime::At(1_000_000_000)),
            ..SetAttr::default()
        };
        let a = e.set_attr("out", &times).unwrap();
        assert_eq!((a.kind, a.mtime_ns), (FileKind::Symlink, 1_000_000_000));
        // Through a directory symlink that climbs out: refused.
        assert!(matches!(
            e.set_attr("updir/secret", &chmod).unwrap_err().code,
            ErrorCode::OutsideExport | ErrorCode::NotADirectory | ErrorCode::NotFound
        ));
        assert_eq!(
            e.set_attr("../outside/secret", &chmod).unwrap_err().code,
            ErrorCode::OutsideExport
        );
        assert_eq!(
            e.readlink("../outside/x").unwrap_err().code,
            ErrorCode::OutsideExport
        );
        assert_eq!(
            e.symlink("../evil", "/etc/passwd").unwrap_err().code,
            ErrorCode::OutsideExport
        );
        assert!(e.remove_kind("updir/secret", RemoveKind::NotDir).is_err());
        assert!(std::fs::metadata(f.outside.join("secret")).is_ok());
        // The ordinary cases work, on the object itself.
        let a = e
            .set_attr(
                "sub/file.txt",
                &SetAttr {
                    mode: Some(0o600),
                    size: Some(2),
                    ..SetAttr::default()
                },
            )
            .unwrap();
        assert_eq!((a.perm, a.size, a.kind), (0o600, 2, FileKind::File));
        assert_eq!(std::fs::read(f.root.join("sub/file.txt")).unwrap(), b"he");
        assert_eq!(mode_of(&f.root.join("sub/file.txt")), 0o600);
        let l = e.symlink("sub/l", "file.txt").unwrap();
        assert_eq!(l.kind, FileKind::Symlink);
        assert_eq!(e.readlink("sub/l").unwrap(), "file.txt");
        assert_eq!(e.statx("sub/l", false).unwrap().kind, FileKind::Symlink);
        // Followed only by the openat2 resolver (the fallback follows none).
        match m {
            ResolveMode::Openat2 => {
                assert_eq!(e.statx("sub/l", true).unwrap().kind, FileKind::File)
            }
            _ => assert_eq!(
                e.statx("sub/l", true).unwrap_err().code,
                ErrorCode::OutsideExport
            ),
        }
        assert_eq!(e.symlink("sub/l", "x").unwrap_err().code, ErrorCode::Exists);
        assert_eq!(
            e.remove_kind("sub", RemoveKind::NotDir).unwrap_err().code,
            ErrorCode::IsADirectory
        );
        assert_eq!(
            e.remove_kind("sub/l", RemoveKind::Dir).unwrap_err().code,
            ErrorCode::NotADirectory
        );
        e.remove_kind("sub/l", RemoveKind::NotDir).unwrap();
        assert!(!f.root.join("sub/l").exists());
        // Hard links only where allowed.
        assert_eq!(
            e.link("sub/file.txt", "hard").unwrap_err().code,
            ErrorCode::NotPermitted
        );
        assert!(!f.root.join("hard").exists());
        // Rename flags.
        std::fs::write(f.root.join("x"), b"x").unwrap();
        std::fs::write(f.root.join("y"), b"y").unwrap();
        assert_eq!(
            e.rename_flags("x", "y", lwio_side::types::RENAME_NOREPLACE)
                .unwrap_err()
                .code,
            ErrorCode::Exists
        );
        e.rename_flags("x", "y", lwio_side::types::RENAME_EXCHANGE)
            .unwrap();
        assert_eq!(std::fs::read(f.root.join("x")).unwrap(), b"y");
        std::fs::remove_file(f.root.join("x")).unwrap();
        std::fs::remove_file(f.root.join("y")).unwrap();
        std::fs::set_permissions(
            f.root.join("sub/file.txt"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        std::fs::write(f.root.join("sub/file.txt"), b"hello").unwrap();
        let st = e.statfs().unwrap();
        assert!(st.blocks > 0 && st.namelen >= 255);
    }
    assert_eq!(mode_of(&f.outside.join("secret")), secret_mode);
    assert_eq!(
        std::fs::metadata(f.outside.join("secret")).unwrap().mtime(),
        secret_mtime
    );
    assert_eq!(std::fs::read(f.outside.join("secret")).unwrap(), b"secret");
    // Where hard links are allowed, link makes a second name.
    let spec = ExportSpec {
        name: "data".into(),
        path: f.root.clone(),
        read_only: false,
        allow_hardlinks: true,
        ..Default::default()
    };
    let e = Export::open(&spec, ResolveMode::Auto).unwrap();
    let a = e.link("sub/file.txt", "hard").unwrap();
    assert_eq!((a.nlink, a.kind), (2, FileKind::File));
    assert_eq!(std::fs::read(f.root.join("hard")).unwrap(), b"hello");
    // A read-only export refuses every change.
    let ro = Export::open(
        &ExportSpec {
            read_only: true,
            ..spec
        },
        ResolveMode::Auto,
    )
    .unwrap();
    assert_eq!(
        ro.set_attr(
            "hard",
            &SetAttr {
                mode: Some(0o600),
                ..SetAttr::default()
            }
        )
        .unwrap_err()
        .code,
        ErrorCode::ReadOnly
    );
    assert_eq!(
        ro.symlink("l2", "hard").unwrap_err().code,
        ErrorCode::ReadOnly
    );
    assert_eq!(ro.link("hard", "h3").unwrap_err().code, ErrorCode::ReadOnly);
    assert_eq!(
        ro.remove_kind("hard", RemoveKind::NotDir).unwrap_err().code,
        ErrorCode::ReadOnly
    );
}
