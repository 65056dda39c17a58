use super::*;
use crate::types::{AttrX, RemoveKind, SetAttr, SetTime, StatFs, RENAME_EXCHANGE};
use proptest::prelude::*;

fn attr() -> Attr {
    Attr {
        kind: FileKind::File,
        perm: 0o644,
        size: 5,
        mtime_ns: 1_700_000_000_000_000_000,
    }
}

fn all_requests() -> Vec<Request> {
    vec![
        Request::Hello {
            version: 1,
            client_name: "app1".into(),
        },
        Request::Login(LoginRequest::Anonymous),
        Request::Login(LoginRequest::Token {
            client_nonce: [7; 32],
            proof: [9; 32],
        }),
        Request::Login(LoginRequest::Password {
            user: "alice".into(),
            password: "pw".into(),
            client_nonce: [3; 32],
        }),
        Request::Login(LoginRequest::UserToken {
            user: "bob".into(),
            client_nonce: [4; 32],
            proof: [5; 32],
        }),
        Request::ListExports,
        Request::ListDir {
            export: "e".into(),
            path: "a/b".into(),
            cookie: 3,
        },
        Request::Stat {
            export: "e".into(),
            path: "x".into(),
        },
        Request::Open {
            export: "e".into(),
            path: "f".into(),
            access: ACCESS_READ | ACCESS_WRITE,
            flags: OPEN_CREATE | OPEN_NO_BUFFERING,
            mode: 0o600,
        },
        Request::Close { handle: 42 },
        Request::Remove {
            export: "e".into(),
            path: "f".into(),
        },
        Request::Rename {
            export: "e".into(),
            from: "a".into(),
            to: "b".into(),
            replace: true,
        },
        Request::Mkdir {
            export: "e".into(),
            path: "d".into(),
            mode: 0o755,
            parents: false,
        },
        Request::SetSize {
            handle: 1,
            size: 1 << 40,
        },
        Request::Fsync {
            handle: 1,
            data_only: true,
        },
        Request::Negotiate {
            request: vec![1, 2, 3],
        },
        Request::Ping,
        Request::Bye,
        Request::StatX {
            export: "e".into(),
            path: "l".into(),
            follow: false,
        },
        Request::StatHandle { handle: 9 },
        Request::SetAttr {
            export: "e".into(),
            path: "f".into(),
            set: SetAttr {
                mode: Some(0o640),
                uid: None,
                gid: Some(100),
                size: Some(7),
                atime: Some(SetTime::Now),
                mtime: Some(SetTime::At(-5)),
            },
        },
        Request::SetAttrHandle {
            handle: 3,
            set: SetAttr::default(),
        },
        Request::Symlink {
            export: "e".into(),
            path: "l".into(),
            target: "../t".into(),
        },
        Request::Readlink {
            export: "e".into(),
            path: "l".into(),
        },
        Request::Statfs { export: "e".into() },
        Request::Stats,
        Request::ListDirX {
            export: "e".into(),
            path: "d".into(),
            cookie: 5,
        },
        Request::Link {
            export: "e".into(),
            from: "a".into(),
            to: "b".into(),
        },
        Request::Fallocate {
            handle: 2,
            mode: 3,
            offset: 4096,
            len: 8192,
        },
        Request::Seek {
            handle: 2,
            offset: 1,
            whence: SEEK_HOLE,
        },
        Request::Lock {
            handle: 1,
            owner: 0xdead_beef,
            kind: 2,
            start: 10,
            len: 0,
            test: true,
        },
        Request::CopyRange {
            src: 1,
            src_offset: 2,
            dst: 3,
            dst_offset: 4,
            len: 5,
        },
        Request::Remove2 {
            export: "e".into(),
            path: "d".into(),
            kind: RemoveKind::Dir,
        },
        Request::Rename2 {
            export: "e".into(),
            from: "a".into(),
            to: "b".into(),
            flags: RENAME_EXCHANGE,
        },
        Request::LeaseDir {
            export: "e".into(),
            path: "d/e".into(),
            want: LEASE_READ | LEASE_HANDLE,
        },
        Request::ReleaseLease { lease_id: 9 },
        Request::WatchBreaks {
            session_id: 4,
            mac: [7; MAC_LEN],
        },
        Request::LeaseBreakAck { lease_id: 9 },
        Request::Resume {
            session_id: 5,
            mac: [3; MAC_LEN],
        },
        Request::Rekey { handle: 11 },
        Request::Publish {
            export: "e".into(),
            name: "w".into(),
            size: 1 << 26,
            addr: 0x7f00_0000_1000,
            rkey: 0x1234_5678,
            rights: MEM_READ | MEM_WRITE,
            channel_key: [3; 16],
        },
        Request::Unpublish {
            export: "e".into(),
            name: "w".into(),
        },
        Request::WaitWrites {
            export: "e".into(),
            name: "w".into(),
            seen: 3,
            timeout_ms: 1000,
        },
        Request::Mknod {
            export: "e".into(),
            path: "p".into(),
            mode: libc::S_IFIFO | 0o640,
            rdev: 0,
        },
        Request::FsyncDir {
            export: "e".into(),
            path: "d".into(),
        },
    ]
}

fn attrx() -> AttrX {
    AttrX {
        kind: FileKind::Symlink,
        perm: 0o777,
        size: 4,
        ino: 0x0102_0304_0506_0708,
        nlink: 1,
        uid: 1000,
        gid: 1001,
        blocks: 8,
        blksize: 4096,
        atime_ns: 1,
        mtime_ns: -2,
        ctime_ns: 3,
    }
}

fn all_responses() -> Vec<Response> {
    vec![
        Response::Ok,
        Response::Error(Error::new(
            ErrorCode::NotFound,
            "e/x: No such file or directory",
        )),
        Response::Hello {
            version: 1,
            server_name: "stor1".into(),
            server_nonce: [3; 32],
            auth_methods: AUTH_TOKEN,
            max_frame: DEFAULT_MAX_FRAME,
        },
        Response::LoginOk {
            session_id: 77,
            server_proof: [5; 32],
        },
        Response::Exports(vec![ExportInfo {
            name: "e".into(),
            read_only: true,
        }]),
        Response::DirPage {
            entries: vec![WireDirEntry {
                name: "f".into(),
                attr: attr(),
            }],
            next_cookie: 0,
        },
        Response::Attr(attr()),
        Response::Opened {
            handle: 1,
            size: 2,
            align: 4096,
            resume_key: vec![0; 26],
            file_id: 0x1234_5678_9abc_def0,
        },
        Response::Resumed { files: 3 },
        Response::Negotiated {
            response: vec![4, 5],
        },
        Response::AttrX(attrx()),
        Response::Target("../t".into()),
        Response::Offset(1 << 33),
        Response::Copied(77),
        Response::LockInfo {
            kind: 1,
            start: 5,
            len: 6,
        },
        Response::LeaseGranted {
            lease_id: 3,
            granted: LEASE_READ,
        },
        Response::LeaseBreak {
            lease_id: 3,
            export: "e".into(),
            path: "".into(),
        },
        Response::Published {
            path: ".lwio-mem/w".into(),
        },
        Response::Writes(7),
        Response::DirPageX {
            entries: vec![("l".into(), attrx())],
            next_cookie: 3,
        },
        Response::Metrics("# TYPE lwio_sessions gauge\nlwio_sessions 1\n# EOF\n".into()),
        Response::StatFs(StatFs {
            bsize: 4096,
            frsize: 4096,
            blocks: 10,
            bfree: 5,
            bavail: 4,
            files: 100,
            ffree: 50,
            namelen: 255,
        }),
    ]
}

#[test]
fn golden_set_attr_and_attrx() {
    // chmod 0640 and mtime = now: mask 0x81, mode, uid, gid, size, atime, mtime.
    let b = Request::SetAttr {
        export: "e".into(),
        path: "f".into(),
        set: SetAttr {
            mode: Some(0o640),
            mtime: Some(SetTime::Now),
            ..SetAttr::default()
        },
    }
    .encode(2);
    let mut want = vec![0x12, 0, 0, 0, 2, 0, 0, 0, 1, 0, b'e', 1, 0, b'f'];
    want.extend_from_slice(&[0x81, 0, 0, 0]);
    want.extend_from_slice(&0o640u32.to_le_bytes());
    want.extend_from_slice(&[0; 32]);
    assert_eq!(b, want);
    let b = Response::AttrX(attrx()).encode(2);
    assert_eq!(b.len(), BODY_HEADER_LEN + crate::types::ATTRX_LEN);
    assert_eq!(&b[..9], &[0x10, 0x80, 0, 0, 2, 0, 0, 0, 3]);
    assert_eq!(&b[13..21], &4u64.to_le_bytes());
    assert_eq!(&b[21..29], &[8, 7, 6, 5, 4, 3, 2, 1]);
    // Unknown mask bits, a time both set and now, unknown rename flags and
    // remove kinds are refused.
    let mut bad = Request::SetAttrHandle {
        handle: 1,
        set: SetAttr::default(),
    }
    .encode(1);
    bad[16] = 0x30;
    assert!(Request::decode(&bad).is_err());
    bad[16] = 0x100u32 as u8;
    bad[17] = 1;
    assert!(Request::decode(&bad).is_err());
    let mut r = Request::Rename2 {
        export: "e".into(),
        from: "a".into(),
        to: "b".into(),
        flags: 0,
    }
    .encode(1);
    let n = r.len();
    r[n - 4] = 3;
    assert!(Request::decode(&r).is_err());
    let mut d = Request::Remove2 {
        export: "e".into(),
        path: "d".into(),
        kind: RemoveKind::Any,
    }
    .encode(1);
    let n = d.len();
    d[n - 1] = 3;
    assert!(Request::decode(&d).is_err());
}

#[test]
fn round_trips() {
    for (i, r) in all_requests().into_iter().enumerate() {
        let b = r.encode(i as u32);
        assert_eq!(Request::decode(&b).unwrap(), (i as u32, r));
    }
    for (i, r) in all_responses().into_iter().enumerate() {
        let b = r.encode(i as u32 + 100);
        assert_eq!(Response::decode(&b).unwrap(), (i as u32 + 100, r));
    }
}

#[test]
fn golden_hello() {
    let b = Request::Hello {
        version: 1,
        client_name: "ab".into(),
    }
    .encode(0x01020304);
    assert_eq!(
        b,
        [
            0x01, 0x00, // type HELLO
            0x00, 0x00, // flags
            0x04, 0x03, 0x02, 0x01, // id
            b'L', b'W', b'S', b'C', // magic
            0x01, 0x00, // version 1
            0x02, 0x00, b'a', b'b', // client name
        ]
    );
}

#[test]
fn golden_stat_and_attr() {
    let b = Request::Stat {
        export: "e".into(),
        path: "f".into(),
    }
    .encode(1);
    assert_eq!(b, [0x05, 0, 0, 0, 1, 0, 0, 0, 1, 0, b'e', 1, 0, b'f']);
    let a = Attr {
        kind: FileKind::Dir,
        perm: 0o755,
        size: 0x1122,
        mtime_ns: -1,
    };
    let b = Response::Attr(a).encode(1);
    let mut want = vec![0x05, 0x80, 0, 0, 1, 0, 0, 0, 2];
    want.extend_from_slice(&0o755u32.to_le_bytes());
    want.extend_from_slice(&[0x22, 0x11, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[0xff; 8]);
    assert_eq!(b, want);
}

#[test]
fn golden_leases() {
    let b = Request::LeaseDir {
        export: "e".into(),
        path: "d".into(),
        want: 3,
    }
    .encode(2);
    assert_eq!(b, [0x1f, 0, 0, 0, 2, 0, 0, 0, 1, 0, b'e', 1, 0, b'd', 3]);
    let b = Response::LeaseGranted {
        lease_id: 0x0102,
        granted: 3,
    }
    .encode(2);
    assert_eq!(b, [0x1f, 0x80, 0, 0, 2, 0, 0, 0, 2, 1, 0, 0, 0, 0, 0, 0, 3]);
    let b = Request::ReleaseLease { lease_id: 5 }.encode(3);
    assert_eq!(b, [0x20, 0, 0, 0, 3, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0]);
    let b = Request::WatchBreaks {
        session_id: 6,
        mac: [0xab; MAC_LEN],
    }
    .encode(4);
    let mut want = vec![0x21, 0, 0, 0, 4, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0];
    want.extend_from_slice(&[0xab; MAC_LEN]);
    assert_eq!(b, want);
    let b = Response::LeaseBreak {
        lease_id: 5,
        export: "e".into(),
        path: "d".into(),
    }
    .encode(0);
    assert_eq!(
        b,
        [0x21, 0x80, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 1, 0, b'e', 1, 0, b'd']
    );
    let b = Request::LeaseBreakAck { lease_id: 5 }.encode(0);
    assert_eq!(b, [0x22, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0]);
    // Unknown lease kinds are refused, in both directions.
    for want in [0u8, 4, 0xff] {
        let mut b = Request::LeaseDir {
            export: "e".into(),
            path: "d".into(),
            want: 1,
        }
        .encode(2);
        *b.last_mut().unwrap() = want;
        assert!(Request::decode(&b).is_err(), "want {want}");
    }
    let mut b = Response::LeaseGranted {
        lease_id: 1,
        granted: 1,
    }
    .encode(2);
    *b.last_mut().unwrap() = 8;
    assert!(Response::decode(&b).is_err());
}

#[test]
fn golden_error_and_login() {
    let b = Response::Error(Error::new(ErrorCode::AuthFailed, "no")).encode(9);
    assert_eq!(b, [0xff, 0x80, 0, 0, 9, 0, 0, 0, 10, 0, 2, 0, b'n', b'o']);
    let b = Request::Login(LoginRequest::Token {
        client_nonce: [0xaa; 32],
        proof: [0xbb; 32],
    })
    .encode(2);
    assert_eq!(b.len(), 8 + 1 + 64);
    assert_eq!(&b[..9], &[0x02, 0, 0, 0, 2, 0, 0, 0, 1]);
    assert_eq!(&b[9..41], &[0xaa; 32]);
    assert_eq!(&b[41..], &[0xbb; 32]);
    let b = Request::Login(LoginRequest::Password {
        user: "u".into(),
        password: "pw".into(),
        client_nonce: [0xcc; 32],
    })
    .encode(3);
    assert_eq!(
        &b[..16],
        &[0x02, 0, 0, 0, 3, 0, 0, 0, 2, 1, 0, b'u', 2, 0, b'p', b'w']
    );
    assert_eq!(&b[16..], &[0xcc; 32]);
    let b = Request::Login(LoginRequest::UserToken {
        user: "u".into(),
        client_nonce: [0xdd; 32],
        proof: [0xee; 32],
    })
    .encode(4);
    assert_eq!(&b[..12], &[0x02, 0, 0, 0, 4, 0, 0, 0, 3, 1, 0, b'u']);
    assert_eq!(&b[12..44], &[0xdd; 32]);
    assert_eq!(&b[44..], &[0xee; 32]);
    let dbg = format!(
        "{:?}",
        LoginRequest::Password {
            user: "u".into(),
            password: "hunter2".into(),
            client_nonce: [0; 32],
        }
    );
    assert!(!dbg.contains("hunter2"), "{dbg}");
}

#[test]
fn golden_open() {
    let b = Request::Open {
        export: "e".into(),
        path: "p".into(),
        access: ACCESS_WRITE,
        flags: OPEN_CREATE | OPEN_TRUNCATE,
        mode: 0o644,
    }
    .encode(5);
    let mut want = vec![
        0x06, 0, 0, 0, 5, 0, 0, 0, 1, 0, b'e', 1, 0, b'p', 2, 0, 0, 0, 5, 0, 0, 0,
    ];
    want.extend_from_slice(&0o644u32.to_le_bytes());
    assert_eq!(b, want);
    // SYNC (0x20, O_SYNC) and WRITE_THROUGH (0x10, O_DSYNC) are two bits.
    let b = Request::Open {
        export: "e".into(),
        path: "p".into(),
        access: ACCESS_READ | ACCESS_WRITE,
        flags: OPEN_SYNC | OPEN_WRITE_THROUGH,
        mode: 0,
    }
    .encode(5);
    assert_eq!(&b[14..22], &[3, 0, 0, 0, 0x30, 0, 0, 0]);
    assert_eq!((OPEN_WRITE_THROUGH, OPEN_SYNC), (0x10, 0x20));
    match Request::decode(&b).unwrap().1 {
        Request::Open { flags, .. } => assert_eq!(flags, OPEN_SYNC | OPEN_WRITE_THROUGH),
        r => panic!("{r:?}"),
    }
}

/// open(2) flags to the side channel's: `O_SYNC` is SYNC, `O_DSYNC` alone
/// WRITE_THROUGH (`O_SYNC` contains the `O_DSYNC` bit).
#[test]
fn open_sync_flags() {
    use crate::types::OpenOptions;
    let of = |fl: i32| {
        let mut o = OpenOptions::READ_WRITE;
        o.set_sync_flags(fl);
        (o.sync, o.write_through)
    };
    assert_eq!(of(0), (false, false));
    assert_eq!(of(libc::O_DSYNC), (false, true));
    assert_eq!(of(libc::O_SYNC), (true, true));
    assert_eq!(of(libc::O_SYNC | libc::O_CREAT), (true, true));
}

#[test]
fn strictness() {
    let mut b = Request::Ping.encode(1);
    b.push(0);
    assert_eq!(
        Request::decode(&b).unwrap_err(),
        DecodeError("trailing bytes")
    );
    let mut b = Request::Ping.encode(1);
    b[2] = 4;
    assert_eq!(
        Request::decode(&b).unwrap_err(),
        DecodeError("unknown flags")
    );
    // FLAG_CREDS with no credentials after the id.
    b[2] = 1;
    assert_eq!(Request::decode(&b).unwrap_err(), DecodeError("truncated"));
    let b = Request::Rename {
        export: "e".into(),
        from: "a".into(),
        to: "b".into(),
        replace: true,
    }
    .encode(1);
    let mut bad = b.clone();
    *bad.last_mut().unwrap() = 2;
    assert!(Request::decode(&bad).is_err());
    let mut b = Request::Hello {
        version: 1,
        client_name: String::new(),
    }
    .encode(1);
    b[8] = b'X';
    assert!(Request::decode(&b).is_err());
    // Unknown open bits.
    let b = Request::Open {
        export: "e".into(),
        path: "p".into(),
        access: 4,
        flags: 0,
        mode: 0,
    }
    .encode(1);
    assert!(Request::decode(&b).is_err());
    let open_flags = |flags| {
        Request::decode(
            &Request::Open {
                export: "e".into(),
                path: "p".into(),
                access: ACCESS_READ,
                flags,
                mode: 0,
            }
            .encode(1),
        )
    };
    assert!(open_flags(0x3f).is_ok(), "every known bit, SYNC included");
    assert_eq!(
        open_flags(0x40).unwrap_err(),
        DecodeError("unknown open access or flag bits")
    );
    // Invalid UTF-8.
    let b = [0x05, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0xff, 0, 0];
    assert_eq!(
        Request::decode(&b).unwrap_err(),
        DecodeError("string is not UTF-8")
    );
    // Huge count.
    let mut b = vec![0x03, 0x80, 0, 0, 1, 0, 0, 0];
    b.extend_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        Response::decode(&b).unwrap_err(),
        DecodeError("count exceeds message")
    );
    // Unknown error codes survive.
    let b = [0xff, 0x80, 0, 0, 1, 0, 0, 0, 0xe7, 0x03, 0, 0];
    match Response::decode(&b).unwrap().1 {
        Response::Error(e) => assert!(e.message.contains("999")),
        r => panic!("{r:?}"),
    }
}

#[test]
fn every_truncation_fails_cleanly() {
    for r in all_requests() {
        let b = r.encode(1);
        for n in 0..b.len() {
            assert!(Request::decode(&b[..n]).is_err(), "{r:?} cut at {n}");
        }
    }
    for r in all_responses() {
        let b = r.encode(1);
        for n in 0..b.len() {
            // Opened without its optional trailing file id is an older
            // server's frame (opened_without_file_id_decodes_as_unknown).
            if matches!(r, Response::Opened { .. }) && n == b.len() - 8 {
                continue;
            }
            assert!(Response::decode(&b[..n]).is_err(), "{r:?} cut at {n}");
        }
    }
}

#[tokio::test]
async fn frames() {
    let (mut a, mut b) = tokio::io::duplex(1 << 16);
    write_frame(&mut a, b"hello").await.unwrap();
    write_frame(&mut a, &[0u8; 100]).await.unwrap();
    assert_eq!(read_frame(&mut b, 1000).await.unwrap().unwrap(), b"hello");
    match read_frame(&mut b, 50).await {
        Err(FrameError::TooLarge(100, 50)) => {}
        r => panic!("{r:?}"),
    }
    drop(a);
    let (mut a, mut b) = tokio::io::duplex(64);
    drop(a.shutdown().await);
    drop(a);
    assert!(read_frame(&mut b, 10).await.unwrap().is_none());
    let (mut a, mut b) = tokio::io::duplex(64);
    a.write_all(&[5, 0]).await.unwrap();
    drop(a);
    assert!(read_frame(&mut b, 10).await.is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = Request::decode(&bytes);
        let _ = Response::decode(&bytes);
    }

    #[test]
    fn mutated_messages_never_panic(idx in 0usize..16, pos in any::<usize>(), val in any::<u8>(), cut in any::<usize>()) {
        let reqs = all_requests();
        let mut b = reqs[idx % reqs.len()].encode(1);
        let p = pos % b.len();
        b[p] = val;
        let c = cut % (b.len() + 1);
        let _ = Request::decode(&b[..c]);
        let resps = all_responses();
        let mut b = resps[idx % resps.len()].encode(1);
        let p = pos % b.len();
        b[p] = val;
        let _ = Response::decode(&b);
    }
}

#[test]
fn publish_golden_bytes_and_bad_rights() {
    let b = Request::Publish {
        export: "e".into(),
        name: "m".into(),
        size: 0x10,
        addr: 0x2000,
        rkey: 0xaabb_ccdd,
        rights: MEM_READ,
        channel_key: [9; 16],
    }
    .encode(2);
    let mut want = vec![0x23, 0, 0, 0, 2, 0, 0, 0, 1, 0, b'e', 1, 0, b'm'];
    want.extend_from_slice(&[0x10, 0, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[0, 0x20, 0, 0, 0, 0, 0, 0]);
    want.extend_from_slice(&[0xdd, 0xcc, 0xbb, 0xaa, 1]);
    want.extend_from_slice(&[9; 16]);
    assert_eq!(b, want);
    // Write without read, and unknown bits, are refused.
    for bad in [0u8, MEM_WRITE, 4, 0xff] {
        let mut b = b.clone();
        b[14 + 16 + 4] = bad;
        assert!(Request::decode(&b).is_err(), "rights {bad:#x}");
    }
    // Truncated anywhere: an error, never a panic.
    for n in 0..b.len() {
        assert!(Request::decode(&b[..n]).is_err());
    }
    let b = Response::Published {
        path: ".lwio-mem/m".into(),
    }
    .encode(2);
    assert_eq!(&b[..8], &[0x23, 0x80, 0, 0, 2, 0, 0, 0]);
}

#[test]
fn opened_without_file_id_decodes_as_unknown() {
    let full = Response::Opened {
        handle: 1,
        size: 2,
        align: 1,
        resume_key: vec![0; 26],
        file_id: 77,
    }
    .encode(5);
    // An older server's frame: the same without the trailing file id.
    let old = &full[..full.len() - 8];
    let (id, r) = Response::decode(old).unwrap();
    assert_eq!(id, 5);
    assert!(matches!(r, Response::Opened { file_id: 0, .. }), "{r:?}");
}

#[test]
fn golden_credentials_and_mknod() {
    let c = Creds {
        uid: 1000,
        gid: 0x0102,
        groups: vec![7, 0x0a0b0c0d],
    };
    let req = Request::FsyncDir {
        export: "e".into(),
        path: "d".into(),
    };
    let b = req.encode_as(9, Some(&c));
    assert_eq!(
        b,
        [
            0x29, 0x00, // type FSYNC_DIR
            0x01, 0x00, // flags: FLAG_CREDS
            9, 0, 0, 0, // id
            0xe8, 0x03, 0, 0, // uid 1000
            0x02, 0x01, 0, 0, // gid
            2, 0, // two groups
            7, 0, 0, 0, 0x0d, 0x0c, 0x0b, 0x0a, // groups
            1, 0, b'e', 1, 0, b'd', // export, path
        ]
    );
    assert_eq!(
        Request::decode_as(&b).unwrap(),
        (9, Some(c.clone()), req.clone())
    );
    // Without credentials the bytes are protocol 1's.
    assert_eq!(req.encode_as(9, None), req.encode(9));
    assert_eq!(Request::decode_as(&req.encode(9)).unwrap(), (9, None, req));
    let m = Request::Mknod {
        export: "e".into(),
        path: "p".into(),
        mode: libc::S_IFIFO | 0o640,
        rdev: 0x0102,
    }
    .encode(1);
    let mut want = vec![0x28, 0, 0, 0, 1, 0, 0, 0, 1, 0, b'e', 1, 0, b'p'];
    want.extend_from_slice(&(libc::S_IFIFO | 0o640).to_le_bytes());
    want.extend_from_slice(&0x0102u64.to_le_bytes());
    assert_eq!(m, want);
}

#[test]
fn credentials_are_bounded_and_requests_only() {
    let many = Creds {
        uid: 1,
        gid: 1,
        groups: (0..200).collect(),
    };
    let b = Request::Ping.encode_as(1, Some(&many));
    let (_, c, _) = Request::decode_as(&b).unwrap();
    assert_eq!(
        c.unwrap().groups,
        (0..MAX_GROUPS as u32).collect::<Vec<_>>()
    );
    // A header claiming more groups than allowed is refused.
    let mut bad = Request::Ping.encode(1);
    bad[2] = 1;
    bad.extend_from_slice(&[1, 0, 0, 0, 1, 0, 0, 0]);
    bad.extend_from_slice(&((MAX_GROUPS as u16) + 1).to_le_bytes());
    bad.extend(std::iter::repeat_n(0, 4 * (MAX_GROUPS + 1)));
    assert_eq!(
        Request::decode_as(&bad).unwrap_err(),
        DecodeError("too many groups in credentials")
    );
    // Credentials cut short, and unknown flags.
    let b = Request::Ping.encode_as(1, Some(&many));
    assert!(Request::decode_as(&b[..12]).is_err());
    let mut f = Request::Ping.encode(1);
    f[2] = 2;
    assert_eq!(
        Request::decode_as(&f).unwrap_err(),
        DecodeError("unknown flags")
    );
    // A response never carries credentials.
    let mut r = Response::Ok.encode(1);
    r[2] = 1;
    r.extend_from_slice(&[0; 10]);
    assert!(Response::decode(&r).is_err());
}

#[test]
fn new_kinds_reach_a_version_1_peer_as_other() {
    let mut a = attrx();
    a.kind = FileKind::Fifo;
    let r = Response::AttrX(a);
    assert_eq!(r.clone().for_version(CREDS_VERSION), r);
    let Response::AttrX(old) = r.for_version(1) else {
        panic!()
    };
    assert_eq!(old.kind, FileKind::Other);
    let page = Response::DirPageX {
        entries: vec![(
            "s".into(),
            AttrX {
                kind: FileKind::Socket,
                ..attrx()
            },
        )],
        next_cookie: 0,
    };
    let Response::DirPageX { entries, .. } = page.for_version(1) else {
        panic!()
    };
    assert_eq!(entries[0].1.kind, FileKind::Other);
    for k in [
        FileKind::Fifo,
        FileKind::Socket,
        FileKind::CharDev,
        FileKind::BlockDev,
    ] {
        assert_eq!(FileKind::from_mode(k.mode_bits() | 0o644), k);
        assert_eq!(FileKind::from_u8(k as u8), Some(k));
    }
}
