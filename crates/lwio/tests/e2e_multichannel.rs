//! Multichannel failover end to end (docs/reconnect.md): a client with two
//! RDMA channels to one `lwio serve` child, files on both, writes and reads
//! in flight from several threads; one channel's TCP connection (soft
//! provider) is cut with `ss -K` in a private network namespace. Every
//! call completes, the data is exact byte for byte, and the files of the
//! lost channel moved to the other one without a reconnect. Then the
//! other channel is cut too: only then does the client reconnect, with
//! both channels again.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::reconnect::{block, cut, in_netns, offset, open_all, rw, survive, Srv, Workers, BLOCK};
use lwio_client::{ClientOptions, File};

const FILES: usize = 4;
/// Threads per file: each writes its own blocks and reads them back.
const PER_FILE: usize = 4;
const THREADS: usize = FILES * PER_FILE;

/// Each thread until `stop` (then at least 4 blocks): WRITE its next block,
/// READ it back, and READ one of its earlier blocks back; every call must
/// return `Ok` with the exact bytes. Returns each thread's block count.
fn workers(files: &Arc<Vec<File>>, stop: &Arc<AtomicBool>, done: &Arc<AtomicUsize>) -> Workers {
    (0..THREADS)
        .map(|t| {
            let (files, stop, done) = (files.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                let f = &files[t % FILES];
                let mut back = vec![0u8; BLOCK];
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) || k < 4 {
                    let want = block(t, k);
                    let n = f
                        .write_at(&want, offset(t, k, THREADS, FILES))
                        .unwrap_or_else(|e| panic!("thread {t} write {k}: {e}"));
                    assert_eq!(n, BLOCK);
                    let n = f
                        .read_at(&mut back, offset(t, k, THREADS, FILES))
                        .unwrap_or_else(|e| panic!("thread {t} read {k}: {e}"));
                    assert!(n == BLOCK && back == want, "thread {t} block {k} differs");
                    let j = (k * 31) % (k + 1);
                    let n = f
                        .read_at(&mut back, offset(t, j, THREADS, FILES))
                        .unwrap_or_else(|e| panic!("thread {t} read {j}: {e}"));
                    assert!(
                        n == BLOCK && back == block(t, j),
                        "thread {t} block {j} differs"
                    );
                    k += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                k
            })
        })
        .collect()
}

/// The local ports of this namespace's TCP connections to `port` (the
/// client ends of the RDMA channels).
fn client_ports(port: &str) -> Vec<String> {
    let out = Command::new("ss")
        .args(["-tnH", "state", "established", "dst", "127.0.0.1"])
        .args(["dport", "=", &format!(":{port}")])
        .output()
        .expect("ss runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter_map(|local| local.rsplit_once(':').map(|(_, p)| p.to_string()))
        .collect()
}

#[test]
fn one_of_two_channels_cut_requests_move_to_the_other() {
    if in_netns("one_of_two_channels_cut_requests_move_to_the_other") {
        fail_over(0);
    }
}

/// The same with the other connection cut first (the one `ss` lists
/// second).
#[test]
fn the_other_channel_cut_requests_move_to_the_first() {
    if in_netns("the_other_channel_cut_requests_move_to_the_first") {
        fail_over(1);
    }
}

/// The client library's info lines of this process, kept to be counted.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    /// Install it (once per process: each test runs in its own, in the
    /// namespace) for `lwio_client::reconnect` at info.
    fn install() -> Log {
        let log = Log::default();
        let w = log.clone();
        tracing_subscriber::fmt()
            .with_env_filter("lwio_client::reconnect=info")
            .with_ansi(false)
            .with_writer(move || w.clone())
            .try_init()
            .expect("the only subscriber of this process");
        log
    }

    /// The lines that contain `what`.
    fn lines(&self, what: &str) -> Vec<String> {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines()
            .filter(|l| l.contains(what))
            .map(str::to_string)
            .collect()
    }

    fn count(&self, what: &str) -> usize {
        self.lines(what).len()
    }
}

/// Cut the client's RDMA connection `first` (0 or 1, in `ss`'s order)
/// under the workload: a failover; then the other: a whole reconnect.
fn fail_over(first: usize) {
    let log = Log::install();
    let dir = tempfile::tempdir().unwrap();
    let srv = Srv::start(dir.path(), "60s");
    let client = srv.connect_opts(ClientOptions {
        channels: 2,
        ..Srv::opts()
    });
    assert_eq!(client.channels(), 2);
    let port = srv.rdma.rsplit_once(':').unwrap().1.to_string();
    let ports = client_ports(&port);
    assert_eq!(ports.len(), 2, "two RDMA connections: {ports:?}");
    let files = open_all(&client, "m", FILES);
    let on: Vec<usize> = files.iter().map(|f| f.channel()).collect();
    assert!(on.contains(&0) && on.contains(&1), "files on both: {on:?}");

    // One channel cut: its files move to the other, no reconnect.
    let resumed = survive(
        &client,
        dir.path(),
        "m",
        &files,
        |stop, done| workers(&files, stop, done),
        || cut(&port, Some(&ports[first])),
    );
    assert_eq!(client.failovers(), 1, "one failover counted");
    assert_eq!(log.count("RDMA channel failed over"), 1, "one line logged");
    assert_eq!(log.count("failovers=1"), 1);
    eprintln!("{}", log.lines("RDMA channel failed over")[0]);
    assert_eq!(client.reconnects(), 0, "no reconnect");
    let now: Vec<usize> = files.iter().map(|f| f.channel()).collect();
    assert!(
        now.iter().all(|&c| c == now[0]),
        "every file on the surviving channel: {now:?} (were {on:?})"
    );
    // A file opened now goes to the surviving channel.
    let g = client.open("after", &rw()).unwrap();
    assert_eq!(g.channel(), now[0]);
    g.write_at(b"after", 0).unwrap();
    eprintln!(
        "failover: files on channels {on:?} now on {now:?}, 200 blocks done {resumed:?} after the cut; {} failovers, {} reconnects",
        client.failovers(),
        client.reconnects()
    );

    // The other channel cut too: no channel is left, the client
    // reconnects, with both channels again.
    let left = client_ports(&port);
    assert_eq!(left.len(), 1, "one RDMA connection left: {left:?}");
    let more = open_all(&client, "n", FILES);
    let again = survive(
        &client,
        dir.path(),
        "n",
        &more,
        |stop, done| workers(&more, stop, done),
        || cut(&port, Some(&left[0])),
    );
    assert!(client.reconnects() >= 1, "a reconnect was counted");
    assert_eq!(client.failovers(), 1, "no failover without a live channel");
    assert_eq!(log.count("RDMA channel failed over"), 1);
    assert!(log.count("reconnected") >= 1, "the reconnect logged");
    assert_eq!(client.channels(), 2);
    assert_eq!(client_ports(&port).len(), 2, "both channels back");
    // The files of the first round work on after the reconnect.
    for (i, f) in files.iter().enumerate() {
        f.write_at(b"again", 0).unwrap();
        let mut b = [0u8; 5];
        assert_eq!(f.read_at(&mut b, 0).unwrap(), 5);
        assert_eq!(&b, b"again", "file m{i}");
    }
    let mut b = [0u8; 5];
    assert_eq!(g.read_at(&mut b, 0).unwrap(), 5);
    assert_eq!(&b, b"after");
    g.close().unwrap();
    eprintln!(
        "then both cut: 200 blocks done {again:?} after; {} failovers, {} reconnects",
        client.failovers(),
        client.reconnects()
    );
}
