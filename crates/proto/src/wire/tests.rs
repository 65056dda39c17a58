//! Golden byte tests (hand-written from docs/protocol.md), round trips and
//! bounded property tests.

use super::auth::{AuthParamsPacket, SignatureAlg, FEATURE_FLUSH};
use super::common::{CancelTarget, CompletionMode, RequestOp};
use super::control::NEGOTIATE_FIXED_LEN;
use super::*;
use crate::status::*;

fn z(n: usize) -> String {
    "00".repeat(n)
}

fn key() -> Guid {
    Guid::from_u128(0x00112233_4455_6677_8899_aabbccddeeff)
}

#[test]
fn guid_layout() {
    assert_eq!(
        key().to_bytes().to_vec(),
        hex("33221100 5544 7766 8899aabbccddeeff")
    );
    assert_eq!(Guid::from_bytes(&key().to_bytes()), Some(key()));
    assert_eq!(key().to_string(), "00112233-4455-6677-8899-aabbccddeeff");
}

#[test]
fn golden_control_header() {
    let mut b = [0u8; 12];
    ControlHeaderRepr { length: 0xa0 }.emit(&mut ControlHeaderPacket::new_unchecked(&mut b[..]));
    assert_eq!(b.to_vec(), hex("4c57494f 01100000 fe00 a000"));
    let p = ControlHeaderPacket::new_checked(&b[..]).unwrap();
    assert_eq!(ControlHeaderRepr::parse(&p).unwrap().length, 0xa0);
    let mut bad = b;
    bad[8] = 0xfd;
    assert!(
        ControlHeaderRepr::parse(&ControlHeaderPacket::new_checked(&bad[..]).unwrap()).is_err()
    );
    assert_eq!(
        ControlHeaderPacket::new_checked(&b[..11]).err(),
        Some(Error::Truncated)
    );
}

fn negotiate_golden_hex() -> Vec<u8> {
    let mut s = String::new();
    s += "4c57494f 01100000 fe00 3401"; // header, Length 308
    s += "61006200"; // "ab"
    s += &z(124);
    s += "33221100 5544 7766 8899aabbccddeeff"; // key
    s += "0004 0200"; // ResponseLength 1024, ProviderCount 2
    s += "69007700"; // "iw"
    s += &z(60);
    s += "0100"; // InstanceCount 1
    s += "0400 0200 0a000001 5c12"; // 10.0.0.1 port 0x125c
    s += "73007700"; // "sw"
    s += &z(60);
    s += "0100";
    s += "0100 0000 7f 00"; // 1-byte address + pad
    hex(&s)
}

fn negotiate_golden_repr() -> NegotiateRequestRepr {
    NegotiateRequestRepr {
        client_name: "ab".into(),
        key: key(),
        response_length: 1024,
        providers: vec![
            AddressBlockRepr {
                name: "iw".into(),
                instances: vec![NetAddressRepr {
                    host_address: vec![10, 0, 0, 1],
                    discriminator: vec![0x5c, 0x12],
                }],
            },
            AddressBlockRepr {
                name: "sw".into(),
                instances: vec![NetAddressRepr {
                    host_address: vec![0x7f],
                    discriminator: vec![],
                }],
            },
        ],
    }
}

#[test]
fn golden_negotiate_request_two_providers() {
    let want = negotiate_golden_hex();
    assert_eq!(want.len(), 308);
    let r = negotiate_golden_repr();
    assert_eq!(r.buffer_len(), 308);
    assert_eq!(r.to_bytes().unwrap(), want);
    assert_eq!(NegotiateRequestRepr::parse(&want).unwrap(), r);
    // Response has the same shape with Reserved = 0.
    let resp = NegotiateResponseRepr {
        server_name: "ab".into(),
        key: key(),
        providers: r.providers.clone(),
    };
    let mut rb = resp.to_bytes().unwrap();
    assert_eq!(&rb[156..158], &[0, 0]);
    rb[156..158].copy_from_slice(&[0, 4]);
    assert_eq!(rb, want);
    // Truncations / bad lengths never panic and fail.
    for n in 0..want.len() {
        assert!(NegotiateRequestRepr::parse(&want[..n]).is_err(), "len {n}");
    }
    let mut bad = want.clone();
    bad[10] = 0x10; // Length 0x110 < actual provider list
    assert!(NegotiateRequestRepr::parse(&bad).is_err());
    let mut bad = want.clone();
    bad[10..12].copy_from_slice(&100u16.to_le_bytes());
    assert_eq!(NegotiateRequestRepr::parse(&bad), Err(Error::Malformed));
    assert_eq!(NEGOTIATE_FIXED_LEN, 160);
}

#[test]
fn golden_resume_key() {
    let k = SrvResumeKey {
        resume_key: 0x1122334455667788,
        timestamp: 1,
        pid: 0x1234,
    };
    assert_eq!(
        k.to_bytes().to_vec(),
        hex("8877665544332211 0100000000000000 3412000000000000")
    );
    let rq = RequestResumeKeyRepr {
        key: k,
        server_name: "\\\\s".into(),
    };
    let b = rq.to_bytes().unwrap();
    assert_eq!(
        b,
        hex("8877665544332211 0100000000000000 3412000000000000 0600 5c005c007300")
    );
    let p = RequestResumeKeyPacket::new_checked(&b[..]).unwrap();
    assert_eq!(p.context(), &hex("5c005c007300")[..]);
    assert_eq!(RequestResumeKeyRepr::parse(&p).unwrap(), rq);
    assert!(RequestResumeKeyPacket::new_checked(&b[..31]).is_err());
}

const READ_HDR: &str = "00100000 0080 03ff 0500 0700 99000000 0020000000000000 \
     00100000007f0000 cdab0000 00000000 11000000 00000000 2222000000000000";

#[test]
fn golden_common_header_read() {
    let want = hex(READ_HDR);
    assert_eq!(want.len(), 56);
    let r = RequestRepr {
        credits: 3,
        sequence: 7,
        tid: 0x99,
        op: RequestOp::Read {
            fid: 5,
            offset: 0x2000,
            length: 0x1000,
            data_va: 0x7f00_0000_1000,
            data_mh: 0xabcd,
            mode: CompletionMode::Interrupt {
                cookie: 0x2222,
                immediate_cookie: 0x11,
            },
        },
    };
    assert_eq!(r.to_bytes().unwrap(), want);
    assert_eq!(RequestRepr::parse(&want).unwrap(), r);
    let p = HeaderPacket::new_checked(&want[..]).unwrap();
    assert_eq!(p.opcode(), 0);
    assert_eq!(p.flags(), Flags(0x80));
    assert_eq!(p.marker(), 0xff);
    assert_eq!(p.status(), 0xff03_8000);
    assert_eq!(p.cookie(), 0x2222);
    assert_eq!(p.immediate_cookie(), 0x11);
    let h = HeaderRepr::parse(&p).unwrap();
    let mut b = [0u8; 56];
    h.emit(&mut HeaderPacket::new_unchecked(&mut b[..]));
    assert_eq!(b.to_vec(), want);
    // Polling mode uses the same bytes as IosMh / IosVa.
    let mut polled = want.clone();
    polled[5] = 0;
    match RequestRepr::parse(&polled).unwrap().op {
        RequestOp::Read { mode, .. } => {
            assert_eq!(
                mode,
                CompletionMode::Polled {
                    ios_va: 0x2222,
                    ios_mh: 0x11
                }
            )
        }
        _ => panic!(),
    }
    // A READ must be exactly 56 bytes.
    let mut long = want.clone();
    long.push(0);
    assert_eq!(RequestRepr::parse(&long), Err(Error::Malformed));
    assert_eq!(RequestRepr::parse(&want[..55]), Err(Error::Truncated));
}

fn auth_params_repr() -> AuthParamsRepr {
    AuthParamsRepr {
        rev_id: LWIO_REV_ID,
        endian: 8,
        page_size: 4096,
        base_sequence: 0,
        max_rdma_window_size: 0x10000,
        max_send_buffer_size: 1024,
        max_recv_buffer_size: 16,
        header_size: 56,
        credits: 8,
        rdma_read_supported: 0,
        key: Some(key()),
        session_id: None,
        signature: Some(vec![0xaa; 32]),
        max_message: 0,
        features: 0,
    }
}

#[test]
fn golden_auth_max_message_option() {
    let r = AuthParamsRepr {
        key: None,
        signature: None,
        max_message: 16 << 20,
        features: 0,
        ..auth_params_repr()
    };
    let b = r.to_bytes().unwrap();
    // Option 4, length 4, 16 MiB little-endian, then END.
    assert_eq!(&b[b.len() - 7..], &[4, 4, 0, 0, 0, 1, 0]);
    assert_eq!(AuthParamsRepr::from_bytes(&b).unwrap(), r);
    // Wrong length, or twice: malformed.
    let mut bad = b.clone();
    bad[b.len() - 6] = 3;
    assert!(AuthParamsRepr::from_bytes(&bad).is_err());
    let mut twice = b[..b.len() - 1].to_vec();
    twice.extend_from_slice(&b[b.len() - 7..]);
    assert_eq!(AuthParamsRepr::from_bytes(&twice), Err(Error::Malformed));
    // Absent (a seed-only peer): 0, and 0 is not emitted.
    let none = AuthParamsRepr {
        max_message: 0,
        features: 0,
        ..r
    };
    assert_eq!(none.to_bytes().unwrap().len(), b.len() - 6);
}

#[test]
fn golden_auth_request_with_options() {
    let params = hex(&format!(
        "4c57494f 0110 0800 0010 0000 00000100 00040000 10000000 3800 0800 0000 \
         0110 33221100 5544 7766 8899aabbccddeeff \
         0320 {} \
         00",
        "aa".repeat(32)
    ));
    assert_eq!(params.len(), 83);
    let want = [
        hex("8b000000 0680 08ff 0000 0000 00000000 0000000000000000 \
             0050000000000000 77000000 00000000 00000000 00000000 0100000000000000"),
        params.clone(),
    ]
    .concat();
    let ap = auth_params_repr();
    assert_eq!(ap.to_bytes().unwrap(), params);
    let r = RequestRepr {
        credits: 8,
        sequence: 0,
        tid: 0,
        op: RequestOp::Auth {
            cookie: 1,
            data_va: 0x5000,
            data_mh: 0x77,
            params: &params,
        },
    };
    assert_eq!(r.to_bytes().unwrap(), want);
    let parsed = RequestRepr::parse(&want).unwrap();
    assert_eq!(parsed, r);
    let pkt = RequestPacket::new_checked(&want[..]).unwrap();
    let app = pkt.auth_params().unwrap();
    assert_eq!(app.total_len().unwrap(), 83);
    assert_eq!(app.credits(), 8);
    let opts: Vec<_> = app
        .options()
        .map(|o| (o.code, o.data.len(), o.offset))
        .collect();
    assert_eq!(opts, vec![(1, 16, 30), (3, 32, 48)]);
    assert_eq!(AuthParamsRepr::parse(&app).unwrap(), ap);
    // Signed bytes = params without the signature option.
    let signed = app.signed_bytes().unwrap();
    assert_eq!(signed, [&params[..48], &params[82..]].concat());
    // Length must equal the message size.
    let mut bad = want.clone();
    bad[0] = 0x8a;
    assert_eq!(RequestRepr::parse(&bad), Err(Error::Malformed));
}

#[test]
fn auth_signatures() {
    let mut ap = auth_params_repr();
    ap.session_id = Some(0x0102030405060708);
    let secret = b"per-session secret";
    let signed = ap
        .to_signed_bytes(SignatureAlg::HmacSha256, secret)
        .unwrap();
    let (r, alg) = AuthParamsRepr::verify(&signed, secret).unwrap();
    assert_eq!(alg, SignatureAlg::HmacSha256);
    assert_eq!(r.session_id, Some(0x0102030405060708));
    assert!(AuthParamsRepr::verify(&signed, b"other").is_err());
    // The HMAC covers the params with the signature option cut out.
    let p = AuthParamsPacket::new_checked(&signed[..]).unwrap();
    let cut = p.signed_bytes().unwrap();
    assert_eq!(cut.len(), signed.len() - 34);
    assert_eq!(
        r.signature.clone().unwrap(),
        SignatureAlg::HmacSha256.compute(secret, &cut)
    );
    let mut tampered = signed.clone();
    tampered[26] ^= 1; // credits
    assert!(AuthParamsRepr::verify(&tampered, secret).is_err());
    // MD5 compatibility: plain digest, the secret is not used.
    let md = ap.to_signed_bytes(SignatureAlg::Md5, b"").unwrap();
    assert_eq!(md.len(), 30 + 18 + 10 + 18 + 1);
    let (_, alg) = AuthParamsRepr::verify(&md, b"anything").unwrap();
    assert_eq!(alg, SignatureAlg::Md5);
    // MD5 of the empty string is a known vector.
    assert_eq!(
        SignatureAlg::Md5.compute(b"", b""),
        hex("d41d8cd98f00b204e9800998ecf8427e")
    );
    // RFC 4231 test case 2.
    assert_eq!(
        SignatureAlg::HmacSha256.compute(b"Jefe", b"what do ya want for nothing?"),
        hex("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")
    );
}

#[test]
fn auth_params_malformed() {
    let good = auth_params_repr().to_bytes().unwrap();
    for n in 0..good.len() {
        assert!(AuthParamsRepr::from_bytes(&good[..n]).is_err());
    }
    let mut bad = good.clone();
    bad[31] = 15; // KEY with length 15
    assert!(AuthParamsRepr::from_bytes(&bad).is_err());
    let mut bad = good.clone();
    bad[0] = b'X';
    assert_eq!(AuthParamsRepr::from_bytes(&bad), Err(Error::Malformed));
    // Unknown options are skipped.
    let mut unk = good[..30].to_vec();
    unk.extend_from_slice(&[0x77, 2, 1, 2, 0]);
    let r = AuthParamsRepr::from_bytes(&unk).unwrap();
    assert_eq!(r.key, None);
    // No signature → cannot compute signed bytes.
    assert!(AuthParamsPacket::new_checked(&unk[..])
        .unwrap()
        .signed_bytes()
        .is_err());
}

#[test]
fn golden_register_message() {
    let fp = FidParamsRepr {
        resume_key: SrvResumeKey {
            resume_key: 1,
            timestamp: 2,
            pid: 3,
        },
        session_id: 0xdead_beef,
        flags_and_attributes: FILE_NO_INTERMEDIATE_BUFFERING,
    };
    let want = [
        hex("60000000 0780 00ff 0000 0000 00000000 0000000000000000 \
             0000000000000000 00000000 00000000 00000000 00000000 0900000000000000"),
        hex("0100000000000000 0200000000000000 0300000000000000 \
             efbeadde00000000 08000000 00000000"),
    ]
    .concat();
    let r = RequestRepr {
        credits: 0,
        sequence: 0,
        tid: 0,
        op: RequestOp::Register {
            cookie: 9,
            params: fp,
        },
    };
    assert_eq!(r.to_bytes().unwrap(), want);
    assert_eq!(RequestRepr::parse(&want).unwrap(), r);
}

#[test]
fn golden_status_response_and_iosb() {
    let s = StatusResponse {
        cookie: 0x0102030405060708,
        ios: IoStatusBlock {
            information: 0x10,
            status: STATUS_ACCESS_DENIED,
        },
    };
    let want = hex("0807060504030201 10000000 220000c0");
    assert_eq!(s.to_bytes().to_vec(), want);
    assert_eq!(StatusResponse::from_bytes(&want).unwrap(), s);
    assert!(StatusResponse::from_bytes(&want[..15]).is_err());
    assert!(StatusResponse::from_bytes(&[want.clone(), vec![0]].concat()).is_err());

    let i = IoStatusBlock {
        information: 0x200,
        status: STATUS_SUCCESS,
    };
    assert_eq!(i.to_bytes().to_vec(), hex("00020000 00000000"));
    assert_eq!(
        IoStatusBlock::from_bytes(&hex("00020000 00000000")).unwrap(),
        i
    );
    assert_eq!(
        IoStatusBlock::SENTINEL.to_bytes().to_vec(),
        hex("ffffffff ffffffff")
    );
    assert_eq!(
        crate::wire::small::POLL_SENTINEL.to_le_bytes().to_vec(),
        IoStatusBlock::SENTINEL.to_bytes().to_vec()
    );
    // Written only once the last byte (Status's top byte) has left 0xFF.
    use crate::wire::small::poll_block_written;
    assert!(!poll_block_written(u64::MAX));
    assert!(!poll_block_written(0xFF00_0000_0000_0000));
    assert!(!poll_block_written(0xFFFF_FF00_0000_0200));
    assert!(poll_block_written(0x0000_0000_0000_0200));
    assert!(poll_block_written(0xC000_0011_0000_0000));

    // Delta credit of -2: Information is i32 two's complement.
    let d = StatusResponse {
        cookie: 0,
        ios: IoStatusBlock {
            information: (-2i32) as u32,
            status: LWIO_NOTIFY_CREDIT,
        },
    };
    assert_eq!(
        d.to_bytes().to_vec(),
        hex("0000000000000000 feffffff 01000000")
    );
    assert!(d.is_credit_delta());
    assert_eq!(d.credit_delta(), -2);
}

#[test]
fn golden_rdma_region_and_vec_read() {
    let r = RdmaRegion {
        data_va: 0x1000,
        data_mh: 5,
        length: 0x1000,
    };
    let mut b = [0u8; 16];
    r.emit(&mut RdmaRegionPacket::new_unchecked(&mut b[..]));
    assert_eq!(b.to_vec(), hex("0010000000000000 05000000 00100000"));
    let r2 = RdmaRegion {
        data_va: 0x9000,
        data_mh: 6,
        length: 0x200,
    };
    let msg = RequestRepr {
        credits: 1,
        sequence: 0,
        tid: 0,
        op: RequestOp::VecRead {
            fid: 1,
            offset: 0,
            length: 0x1200,
            page_size: 0x1000,
            regions: vec![r, r2],
            mode: CompletionMode::Polled {
                ios_va: 0xa000,
                ios_mh: 9,
            },
        },
    };
    let want = [
        hex("00120000 0200 01ff 0100 0000 00000000 0000000000000000 \
             0000000000000000 0200 0010 00000000 09000000 00000000 00a0000000000000"),
        hex("0010000000000000 05000000 00100000 0090000000000000 06000000 00020000"),
    ]
    .concat();
    assert_eq!(msg.to_bytes().unwrap(), want);
    assert_eq!(RequestRepr::parse(&want).unwrap(), msg);
    let pkt = RequestPacket::new_checked(&want[..]).unwrap();
    let regs: Vec<_> = pkt
        .regions()
        .map(|p| RdmaRegion::parse(&p).unwrap())
        .collect();
    assert_eq!(regs, vec![r, r2]);
    // Region count must match NumPages.
    assert_eq!(
        RequestRepr::parse(&want[..want.len() - 16]),
        Err(Error::Truncated)
    );
}

#[test]
fn golden_write_and_credit_and_interrupt() {
    let msg = RequestRepr {
        credits: 2,
        sequence: 1,
        tid: 0,
        op: RequestOp::Write {
            fid: 3,
            offset: 0x10,
            data: b"hi",
            mode: CompletionMode::Interrupt {
                cookie: 5,
                immediate_cookie: 0,
            },
        },
    };
    let want = [
        hex("02000000 0180 02ff 0300 0100 00000000 1000000000000000 \
             0000000000000000 00000000 00000000 00000000 00000000 0500000000000000"),
        b"hi".to_vec(),
    ]
    .concat();
    assert_eq!(msg.to_bytes().unwrap(), want);
    assert_eq!(RequestRepr::parse(&want).unwrap(), msg);
    assert_eq!(
        RequestPacket::new_checked(&want[..]).unwrap().write_data(),
        b"hi"
    );
    assert_eq!(RequestRepr::parse(&want[..57]), Err(Error::Truncated));

    let c = RequestRepr {
        credits: 0,
        sequence: 0,
        tid: 0,
        op: RequestOp::Credit {
            cookie: 7,
            value: -2,
        },
    };
    let want = hex("38000000 0880 00ff 0000 0000 00000000 00000000feffffff \
         0000000000000000 00000000 00000000 00000000 00000000 0700000000000000");
    assert_eq!(c.to_bytes().unwrap(), want);
    assert_eq!(RequestRepr::parse(&want).unwrap(), c);

    let i = RequestRepr {
        credits: 0,
        sequence: 0,
        tid: 0,
        op: RequestOp::Interrupt { cookie: 8 },
    };
    let b = i.to_bytes().unwrap();
    assert_eq!(b[5], 0xC0);
    assert_eq!(b[4], 9);
    assert_eq!(RequestRepr::parse(&b).unwrap(), i);
}

#[test]
fn structural_violations() {
    let base = hex(READ_HDR);
    let mut b = base.clone();
    b[4] = 10; // unknown opcode
    assert_eq!(RequestRepr::parse(&b), Err(Error::Malformed));
    let mut b = base.clone();
    b[5] = 0x81; // unknown flag bit
    assert_eq!(RequestRepr::parse(&b), Err(Error::Malformed));
    let mut b = base.clone();
    b[5] = 0xa0; // COLLAPSE on READ
    assert_eq!(RequestRepr::parse(&b), Err(Error::Malformed));
    let mut b = base.clone();
    b[4] = 4; // CLOSE without INTERRUPT
    b[5] = 0;
    assert_eq!(RequestRepr::parse(&b), Err(Error::Malformed));
}

/// CANCEL (§5.9): DataVa 0 is the original whole-Fid form whatever Offset
/// and DataMh hold; 1 names a Cookie (Offset), 2 a status block (Offset =
/// IosVa, DataMh = IosMh); anything else is malformed.
#[test]
fn cancel_target_bytes() {
    let cancel = |target: Option<CancelTarget>| RequestRepr {
        credits: 1,
        sequence: 2,
        tid: 3,
        op: match target {
            None => RequestOp::Cancel { fid: 7, cookie: 9 },
            Some(target) => RequestOp::CancelIo {
                fid: 7,
                cookie: 9,
                target,
            },
        },
    };
    // Offset 16..24, DataVa 24..32, DataMh 32..36, Cookie 48..56.
    let whole = cancel(None).to_bytes().unwrap();
    assert_eq!(whole.len(), 56);
    assert_eq!(whole[4], 5);
    assert_eq!(whole[5], 0x80);
    assert_eq!(&whole[16..36], &[0u8; 20]);
    assert_eq!(&whole[48..56], &9u64.to_le_bytes());
    let mut old = whole.clone();
    old[16..24].copy_from_slice(&0x55u64.to_le_bytes());
    old[32..36].copy_from_slice(&0x66u32.to_le_bytes());
    assert_eq!(RequestRepr::parse(&old).unwrap(), cancel(None));

    let by_cookie = cancel(Some(CancelTarget::Cookie(0x1234)));
    let b = by_cookie.to_bytes().unwrap();
    assert_eq!(&b[16..24], &0x1234u64.to_le_bytes());
    assert_eq!(&b[24..32], &1u64.to_le_bytes());
    assert_eq!(&b[32..36], &[0u8; 4]);
    assert_eq!(RequestRepr::parse(&b).unwrap(), by_cookie);

    let polled = cancel(Some(CancelTarget::Polled {
        ios_va: 0x9_0008,
        ios_mh: 0xabcd,
    }));
    let b = polled.to_bytes().unwrap();
    assert_eq!(&b[16..24], &0x9_0008u64.to_le_bytes());
    assert_eq!(&b[24..32], &2u64.to_le_bytes());
    assert_eq!(&b[32..36], &0xabcdu32.to_le_bytes());
    assert_eq!(RequestRepr::parse(&b).unwrap(), polled);

    let mut bad = b.clone();
    bad[24] = 3;
    assert_eq!(RequestRepr::parse(&bad), Err(Error::Malformed));
}

/// A CANCEL target names exactly the request sent with those completion
/// fields: the mode counts, not only the 64-bit value.
#[test]
fn cancel_target_matches_its_request_only() {
    let int = CompletionMode::Interrupt {
        cookie: 5,
        immediate_cookie: 77,
    };
    let polled = CompletionMode::Polled {
        ios_va: 5,
        ios_mh: 1,
    };
    assert!(CancelTarget::of(&int).matches(&int));
    assert!(!CancelTarget::of(&int).matches(&polled));
    assert!(!CancelTarget::of(&polled).matches(&int));
    assert!(!CancelTarget::Polled {
        ios_va: 5,
        ios_mh: 2
    }
    .matches(&polled));
}

#[test]
fn vec_write_collapse_payload_is_one_page() {
    let page = vec![7u8; 512];
    let msg = RequestRepr {
        credits: 0,
        sequence: 0,
        tid: 0,
        op: RequestOp::VecWrite {
            fid: 1,
            offset: 0,
            length: 512 * 3 + 100,
            num_pages: 4,
            page_size: 512,
            collapse: true,
            data: &page,
            mode: CompletionMode::Interrupt {
                cookie: 1,
                immediate_cookie: 0,
            },
        },
    };
    let b = msg.to_bytes().unwrap();
    assert_eq!(b.len(), 56 + 512);
    assert_eq!(b[5], 0xA0);
    assert_eq!(RequestRepr::parse(&b).unwrap(), msg);
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> ProptestConfig {
        ProptestConfig {
            cases: 256,
            ..ProptestConfig::default()
        }
    }

    fn mode() -> impl Strategy<Value = CompletionMode> {
        prop_oneof![
            (any::<u64>(), any::<u32>()).prop_map(|(cookie, immediate_cookie)| {
                CompletionMode::Interrupt {
                    cookie,
                    immediate_cookie,
                }
            }),
            (any::<u64>(), any::<u32>())
                .prop_map(|(ios_va, ios_mh)| CompletionMode::Polled { ios_va, ios_mh }),
        ]
    }

    proptest! {
        #![proptest_config(cfg())]

        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = RequestRepr::parse(&data);
            let _ = AuthParamsRepr::from_bytes(&data);
            if let Ok(p) = AuthParamsPacket::new_checked(&data[..]) {
                let _ = p.signed_bytes();
                let _ = p.options().count();
            }
            let _ = NegotiateRequestRepr::parse(&data);
            let _ = NegotiateResponseRepr::parse(&data);
            if let Ok(p) = RequestResumeKeyPacket::new_checked(&data[..]) {
                let _ = RequestResumeKeyRepr::parse(&p);
            }
            let _ = StatusResponse::from_bytes(&data);
            let _ = IoStatusBlock::from_bytes(&data);
            if let Ok(p) = FidParamsPacket::new_checked(&data[..]) {
                let _ = FidParamsRepr::parse(&p);
            }
            if let Ok(p) = RdmaRegionPacket::new_checked(&data[..]) {
                let _ = RdmaRegion::parse(&p);
            }
            if let Ok(p) = RequestPacket::new_checked(&data[..]) {
                let _ = p.regions().count();
                let _ = p.auth_params();
                let _ = p.fid_params();
            }
        }

        #[test]
        fn arbitrary_header_fields_never_panic(
            hdr in proptest::collection::vec(any::<u8>(), 56),
            op in 0u8..12, flags in prop_oneof![Just(0u8), Just(0x80), Just(0xa0), Just(0xc0), any::<u8>()],
            tail in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut b = hdr;
            b[4] = op;
            b[5] = flags;
            b.extend_from_slice(&tail);
            if let Ok(r) = RequestRepr::parse(&b) {
                // Anything that parses re-emits to a message that parses equal.
                let again = r.to_bytes().unwrap();
                prop_assert_eq!(RequestRepr::parse(&again).unwrap(), r);
            }
        }

        #[test]
        fn header_round_trip(
            length in any::<u32>(), opcode in any::<u8>(), flags in any::<u8>(),
            credits in any::<u8>(), marker in any::<u8>(), fid in any::<u16>(),
            sequence in any::<u16>(), tid in any::<u32>(), offset in any::<u64>(),
            data_va in any::<u64>(), data_mh in any::<u32>(), ios_mh in any::<u32>(),
            ios_va in any::<u64>()
        ) {
            let h = HeaderRepr { length, opcode, flags: Flags(flags), credits, marker, fid,
                sequence, tid, offset, data_va, data_mh, ios_mh, ios_va };
            let mut b = [0u8; 56];
            h.emit(&mut HeaderPacket::new_unchecked(&mut b[..]));
            prop_assert_eq!(HeaderRepr::parse(&HeaderPacket::new_checked(&b[..]).unwrap()).unwrap(), h);
        }

        #[test]
        fn request_round_trip(
            fid in any::<u16>(), offset in any::<u64>(), length in any::<u32>(),
            va in any::<u64>(), mh in any::<u32>(), m in mode(),
            data in proptest::collection::vec(any::<u8>(), 0..64),
            regions in proptest::collection::vec((any::<u64>(), any::<u32>(), any::<u32>()), 0..8),
            cookie in any::<u64>(), value in any::<i32>(), which in 0u8..10, data_only in any::<bool>(),
            credits in any::<u8>(), sequence in any::<u16>(), tid in any::<u32>(),
        ) {
            let op = match which {
                0 => RequestOp::Read { fid, offset, length, data_va: va, data_mh: mh, mode: m },
                1 => RequestOp::Write { fid, offset, data: &data, mode: m },
                2 => RequestOp::VecRead { fid, offset, length, page_size: 4096,
                    regions: regions.iter().map(|&(data_va, data_mh, length)| RdmaRegion { data_va, data_mh, length }).collect(),
                    mode: m },
                3 => RequestOp::VecWrite { fid, offset, length: data.len() as u32, num_pages: 1,
                    page_size: 4096, collapse: false, data: &data, mode: m },
                4 => RequestOp::Close { fid, cookie },
                5 => RequestOp::Cancel { fid, cookie },
                8 => RequestOp::CancelIo { fid, cookie, target: CancelTarget::of(&m) },
                6 => RequestOp::Credit { cookie, value },
                9 => RequestOp::Flush { fid, cookie, data_only },
                _ => RequestOp::Interrupt { cookie },
            };
            let r = RequestRepr { credits, sequence, tid, op };
            let b = r.to_bytes().unwrap();
            prop_assert_eq!(b.len(), r.buffer_len());
            prop_assert_eq!(RequestRepr::parse(&b).unwrap(), r);
        }

        #[test]
        fn small_structs_round_trip(cookie in any::<u64>(), info in any::<u32>(), st in any::<u32>(),
            va in any::<u64>(), mh in any::<u32>(), len in any::<u32>(),
            rk in any::<(u64, u64, u64)>(), sid in any::<u64>(), fl in any::<u32>()) {
            let s = StatusResponse { cookie, ios: IoStatusBlock { information: info, status: st } };
            prop_assert_eq!(StatusResponse::from_bytes(&s.to_bytes()).unwrap(), s);
            let r = RdmaRegion { data_va: va, data_mh: mh, length: len };
            let mut b = [0u8; 16];
            r.emit(&mut RdmaRegionPacket::new_unchecked(&mut b[..]));
            prop_assert_eq!(RdmaRegion::parse(&RdmaRegionPacket::new_checked(&b[..]).unwrap()).unwrap(), r);
            let f = FidParamsRepr { resume_key: SrvResumeKey { resume_key: rk.0, timestamp: rk.1, pid: rk.2 },
                session_id: sid, flags_and_attributes: fl };
            let mut b = [0u8; 40];
            f.emit(&mut FidParamsPacket::new_unchecked(&mut b[..]));
            prop_assert_eq!(FidParamsRepr::parse(&FidParamsPacket::new_checked(&b[..]).unwrap()).unwrap(), f);
        }

        #[test]
        fn auth_params_round_trip(ps in any::<u16>(), bs in any::<u16>(), w in any::<u32>(),
            cr in any::<u16>(), k in proptest::option::of(any::<u128>()), mm in any::<u32>(), feat in any::<u32>(),
            sid in proptest::option::of(any::<u64>()), sig in proptest::option::of(prop_oneof![Just(16usize), Just(32usize)])) {
            let r = AuthParamsRepr { rev_id: LWIO_REV_ID, endian: 8, page_size: ps, base_sequence: bs,
                max_rdma_window_size: w, max_send_buffer_size: w, max_recv_buffer_size: w,
                header_size: 56, credits: cr, rdma_read_supported: 1,
                key: k.map(Guid::from_u128), session_id: sid, signature: sig.map(|n| vec![0x5a; n]), max_message: mm, features: feat };
            let b = r.to_bytes().unwrap();
            prop_assert_eq!(b.len(), r.buffer_len());
            prop_assert_eq!(AuthParamsRepr::from_bytes(&b).unwrap(), r);
        }

        #[test]
        fn negotiate_round_trip(name in "[a-z]{0,20}", k in any::<u128>(), rl in any::<u16>(),
            provs in proptest::collection::vec(("[a-z]{1,10}", proptest::collection::vec(
                (proptest::collection::vec(any::<u8>(), 0..17), proptest::collection::vec(any::<u8>(), 0..5)), 0..3)), 0..4)) {
            let r = NegotiateRequestRepr { client_name: name, key: Guid::from_u128(k), response_length: rl,
                providers: provs.into_iter().map(|(n, is)| AddressBlockRepr { name: n,
                    instances: is.into_iter().map(|(h, d)| NetAddressRepr { host_address: h, discriminator: d }).collect() }).collect() };
            let b = r.to_bytes().unwrap();
            prop_assert_eq!(b.len() % 2, 0);
            prop_assert_eq!(NegotiateRequestRepr::parse(&b).unwrap(), r);
        }
    }
}

#[test]
fn golden_auth_features_option() {
    let r = AuthParamsRepr {
        key: None,
        signature: None,
        features: FEATURE_FLUSH,
        ..auth_params_repr()
    };
    let b = r.to_bytes().unwrap();
    // Option 5, length 4, the bit mask little-endian, then END.
    assert_eq!(&b[b.len() - 7..], &[5, 4, 1, 0, 0, 0, 0]);
    assert_eq!(AuthParamsRepr::from_bytes(&b).unwrap(), r);
    // Wrong length, or twice: malformed.
    let mut bad = b.clone();
    bad[b.len() - 6] = 2;
    assert!(AuthParamsRepr::from_bytes(&bad).is_err());
    let mut twice = b[..b.len() - 1].to_vec();
    twice.extend_from_slice(&b[b.len() - 7..]);
    assert_eq!(AuthParamsRepr::from_bytes(&twice), Err(Error::Malformed));
    // Absent (a seed-only or older peer): 0, and 0 is not emitted.
    let none = AuthParamsRepr { features: 0, ..r };
    assert_eq!(none.to_bytes().unwrap().len(), b.len() - 6);
}

#[test]
fn golden_flush() {
    let r = RequestRepr {
        credits: 3,
        sequence: 0,
        tid: 0,
        op: RequestOp::Flush {
            fid: 0x0102,
            cookie: 0x1122_3344_5566_7788,
            data_only: true,
        },
    };
    let b = r.to_bytes().unwrap();
    assert_eq!(b.len(), 56);
    let mut want = vec![0u8; 56];
    want[0] = 56; // Length: the message
    want[4] = 11; // FLUSH
    want[5] = Flags::INTERRUPT;
    want[6] = 3;
    want[7] = 0xFF;
    want[8..10].copy_from_slice(&0x0102u16.to_le_bytes());
    want[24] = 1; // DataVa 1: fdatasync
    want[48..56].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(b, want);
    assert_eq!(RequestRepr::parse(&b).unwrap(), r);
    // DataVa 0 is fsync; anything else is malformed.
    let mut all = want.clone();
    all[24] = 0;
    assert!(matches!(
        RequestRepr::parse(&all).unwrap().op,
        RequestOp::Flush {
            data_only: false,
            ..
        }
    ));
    let mut bad = want.clone();
    bad[24] = 2;
    assert_eq!(RequestRepr::parse(&bad), Err(Error::Malformed));
    // Without the INTERRUPT flag (it is not an I/O), or longer: malformed.
    let mut polled = want.clone();
    polled[5] = 0;
    assert_eq!(RequestRepr::parse(&polled), Err(Error::Malformed));
    let mut long = want.clone();
    long.push(0);
    long[0] = 57;
    assert_eq!(RequestRepr::parse(&long), Err(Error::Malformed));
}
