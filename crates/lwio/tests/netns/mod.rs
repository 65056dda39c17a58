//! Shared by the tests that cut a socket with `ss -K`, which needs a
//! network namespace of their own.

use std::process::Command;

/// Outside a namespace: run this test binary's test `name` again inside
/// `unshare -rn` (its own loopback, where `ss -K` may destroy sockets),
/// pass or fail with it, and return `false`. Inside: return `true` (go on).
pub fn inside(name: &str) -> bool {
    if std::env::var_os("LWIO_TEST_IN_NETNS").is_some() {
        return true;
    }
    let me = std::env::current_exe().unwrap();
    let out = Command::new("unshare")
        .args(["-rn", "sh", "-c", "ip link set lo up && exec \"$0\" \"$@\""])
        .arg(&me)
        .args(["--exact", name, "--nocapture"])
        .env("LWIO_TEST_IN_NETNS", "1")
        .output()
        .expect("unshare runs (util-linux)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "in the namespace: {text}");
    assert!(
        text.contains("1 passed"),
        "the test ran in the namespace: {text}"
    );
    eprint!("{text}");
    false
}

/// Destroy this namespace's sockets to 127.0.0.1:`port` (`ss -K`); at
/// least one must go.
pub fn cut(port: &str) {
    let ss = Command::new("ss")
        .args(["-K", "dst", "127.0.0.1", "dport", "=", &format!(":{port}")])
        .output()
        .expect("ss runs");
    let killed = String::from_utf8_lossy(&ss.stdout).into_owned();
    assert!(
        killed.contains(&format!("127.0.0.1:{port}")),
        "ss -K killed the RDMA socket: {killed}"
    );
}
