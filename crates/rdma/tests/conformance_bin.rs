//! The `lwio-conformance` binary: argument handling and its output contract
//! (`PASS`/`FAIL`/`SKIP`/`XFAIL`/`XPASS` lines, `K expected deviations`, a final
//! `N passed, M failed, K skipped`).

use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lwio-conformance"))
}

#[test]
fn runs_selected_cases_soft_to_soft() {
    let out = bin()
        .args([
            "--server-provider",
            "soft",
            "--client-provider",
            "soft",
            "--server-device",
            "soft0",
            "--client-device",
            "soft0",
            "--addr",
            "127.0.0.1:0",
            "--crc",
            "on",
            "--only",
            "send_recv_sizes,cm_reject_private_data,write_with_imm",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 5, "{text}");
    // Suite order, not --only order.
    assert_eq!(lines[0], "PASS send_recv_sizes");
    // The soft provider has RDMA Write with Immediate (RFC 7306) since
    // 2026-11-29; the SKIP line's format is checked in the library
    // (`conformance::deviation_tests::case_result_lines`).
    assert_eq!(lines[1], "PASS write_with_imm", "{text}");
    assert_eq!(lines[2], "PASS cm_reject_private_data");
    assert_eq!(lines[3], "0 expected deviations (server soft, client soft)");
    assert_eq!(lines[4], "3 passed, 0 failed, 0 skipped");
}

#[test]
fn missing_provider_fails_cleanly() {
    let out = bin()
        .args(["--client-provider", "nosuch", "--only", "send_recv_sizes"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("FAIL setup: ")),
        "{text}"
    );
    assert_eq!(text.lines().last(), Some("0 passed, 1 failed"));
}

#[test]
fn lists_cases_and_rejects_bad_arguments() {
    let out = bin().arg("--list").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.lines().any(|l| l == "prot_write_wrong_key"), "{text}");
    let out = bin().arg("--bogus").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}
