//! The header is what cbindgen makes of this crate, and the API's checks
//! hold without a server (the C programs in tests/c exercise it with one:
//! scripts/capi-tests.sh).

use super::*;

#[test]
fn the_checked_in_header_is_current() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let mut out = Vec::new();
    cbindgen::generate(dir)
        .expect("cbindgen reads the crate")
        .write(&mut out);
    let fresh = String::from_utf8(out).unwrap();
    let path = std::path::Path::new(dir).join("include/lwio.h");
    if std::env::var_os("LWIO_BLESS_HEADER").is_some() {
        std::fs::write(&path, fresh.as_bytes()).unwrap();
        return;
    }
    let old = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        old == fresh,
        "crates/capi/include/lwio.h is stale: regenerate it with \
         LWIO_BLESS_HEADER=1 cargo test -p lwio-capi the_checked_in_header"
    );
}

fn msg() -> String {
    // SAFETY: lwio_errmsg returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(lwio_errmsg()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn bad_calls_fail_with_their_errno_and_a_message() {
    assert_eq!(lwio_close(-1), -libc::EBADF);
    assert!(msg().contains("fd -1"), "{}", msg());
    assert_eq!(lwio_close(12345), -libc::EBADF);
    let mut b = [0u8; 4];
    // SAFETY: valid buffers; the fds are not open.
    unsafe {
        assert_eq!(
            lwio_pread(7, b.as_mut_ptr().cast(), 4, 0),
            -i64::from(libc::EBADF)
        );
        assert_eq!(
            lwio_pwrite(7, b.as_ptr().cast(), 4, 0),
            -i64::from(libc::EBADF)
        );
        assert_eq!(
            lwio_open(std::ptr::null(), c"x".as_ptr(), 0, 0),
            -libc::EBADF
        );
        assert_eq!(
            lwio_open(0x1000 as *const LwioClient, c"x".as_ptr(), 0, 0),
            -libc::EBADF,
            "a pointer that is not a live client"
        );
        assert!(lwio_connect(std::ptr::null(), std::ptr::null()).is_null());
        assert!(msg().contains("url is NULL"));
        assert_eq!(lwio_disconnect(std::ptr::null_mut()), -libc::EBADF);
        assert_eq!(lwio_buf_free(b.as_mut_ptr().cast()), -libc::EINVAL);
        assert_eq!(
            lwio_publish(
                std::ptr::null(),
                c"m".as_ptr(),
                b.as_mut_ptr().cast(),
                0,
                std::ptr::null_mut(),
                0
            ),
            -i64::from(libc::EBADF)
        );
        assert_eq!(lwio_fstat(3, std::ptr::null_mut()), -libc::EBADF);
        assert_eq!(
            lwio_submit(std::ptr::null(), std::ptr::null(), 1),
            -libc::EBADF
        );
    }
    assert_eq!(lwio_unpublish(99), -libc::EINVAL);
    assert!(msg().contains("no memory object 99"), "{}", msg());
    assert_eq!(lwio_fsync(0, 0), -libc::EBADF);
    assert_eq!(lwio_ftruncate(0, 0), -libc::EBADF);
}

#[test]
fn connect_failures_are_one_line() {
    let mut o = std::mem::MaybeUninit::<lwio_options>::uninit();
    // SAFETY: init writes every field; the strings are literals.
    unsafe {
        lwio_options_init(o.as_mut_ptr());
        let mut o = o.assume_init();
        o.no_tls = 1;
        o.token = c"0123456789abcdef0123456789abcdef".as_ptr();
        o.connect_timeout_ms = 2000;
        let c = lwio_connect(c"lwio://127.0.0.1:1/data".as_ptr(), &o);
        assert!(c.is_null());
        assert!(msg().contains("cannot connect to 127.0.0.1:1"), "{}", msg());
        o.fingerprint = c"sha256:nonsense".as_ptr();
        o.no_tls = 0;
        assert!(lwio_connect(c"lwio://127.0.0.1:1/data".as_ptr(), &o).is_null());
        assert!(msg().starts_with("fingerprint"), "{}", msg());
    }
}

#[test]
fn a_panic_inside_becomes_eio_with_its_message() {
    let r = guard(-libc::EIO, || -> c_int { panic!("boom") });
    assert_eq!(r, -libc::EIO);
    assert!(msg().contains("boom"), "{}", msg());
}

/// `O_SYNC` through the C API reaches the server as `O_SYNC` (issue 31):
/// it used to be sent as write-through and opened `O_DSYNC`. The server is
/// a default one (`Service::start`: TLS with a self-signed certificate)
/// and the options are the defaults but for the token file and the
/// known_hosts file (trusted on first use), both in a temporary directory.
#[test]
fn o_sync_is_o_sync_at_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("ex");
    std::fs::create_dir(&data).unwrap();
    let mut config = lwio_server::config::Config {
        listen: "127.0.0.1:0".into(),
        token_file: Some(dir.path().join("token")),
        provider: lwio_client::ProviderChoice::Soft,
        ..Default::default()
    };
    config.set_export(&lwio_server::fs::ExportSpec {
        name: "ex".into(),
        path: data.clone(),
        ..Default::default()
    });
    let s = lwio_server::Service::start(config).unwrap();
    let url = std::ffi::CString::new(format!("lwio://{}/ex", s.side_addr())).unwrap();
    let token_file = std::ffi::CString::new(dir.path().join("token").to_str().unwrap()).unwrap();
    let known_hosts =
        std::ffi::CString::new(dir.path().join("known_hosts").to_str().unwrap()).unwrap();
    let mut o = std::mem::MaybeUninit::<lwio_options>::uninit();
    // SAFETY: init writes every field; the strings outlive the calls; the
    // client is disconnected once, after its descriptor is closed.
    unsafe {
        lwio_options_init(o.as_mut_ptr());
        let mut o = o.assume_init();
        o.token_file = token_file.as_ptr();
        o.known_hosts = known_hosts.as_ptr();
        let c = lwio_connect(url.as_ptr(), &o);
        assert!(!c.is_null(), "{}", msg());
        let known = std::fs::read_to_string(dir.path().join("known_hosts")).unwrap();
        assert!(known.contains(" sha256:"), "trusted on first use: {known}");
        let fd = lwio_open(
            c,
            c"s.bin".as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_SYNC,
            0o600,
        );
        assert!(fd >= 0, "{}", msg());
        let flags = server_fd_flags(&data.join("s.bin"));
        assert!(
            !flags.is_empty() && flags.iter().all(|f| f & libc::O_SYNC == libc::O_SYNC),
            "the server's descriptors are O_SYNC (0o4010000): {:?}",
            flags.iter().map(|f| format!("{f:o}")).collect::<Vec<_>>()
        );
        assert_eq!(lwio_close(fd), 0);
        assert_eq!(lwio_disconnect(c), 0);
    }
}

/// Open flags of this process's descriptors of `path` (the in-process
/// server's), from /proc/self/fdinfo.
fn server_fd_flags(path: &std::path::Path) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if std::fs::read_link(e.path()).ok().as_deref() != Some(path) {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            e.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        if let Some(l) = info.lines().find(|l| l.starts_with("flags:")) {
            out.push(i32::from_str_radix(l[6..].trim(), 8).unwrap());
        }
    }
    out
}
