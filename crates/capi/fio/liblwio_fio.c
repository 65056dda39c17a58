/*
 * liblwio_fio.c - a fio ioengine for lwio, on liblwio's batch interface.
 *
 *   fio --ioengine=external:/path/liblwio_fio.so --lwio_url=lwio://HOST:PORT/EXPORT \
 *       --filename=PATH/ON/THE/EXPORT --rw=randread --bs=4k --iodepth=32 --size=64M ...
 *
 * Each fio job (process or thread) connects once (init) and keeps its own
 * lwio connection. queue() stages an lwio_op, lwio_submit sends the staged
 * ones (at commit(), or with lwio_batch at the next reap, in one call),
 * getevents() reaps with lwio_reap (with lwio_batch, all that completed,
 * handed to fio as it asks) and event() hands back the io_u. fio's I/O buffers are allocated with lwio_buf_alloc
 * (iomem_alloc), registered once, so reads land in them with no copy.
 * fsync/fdatasync run synchronously once the job's I/Os in flight are
 * reaped (liblwio has no batch fsync); trim is not supported.
 *
 * Files are paths on the export named by lwio_url (FIO_DISKLESSIO: fio
 * stats and creates nothing locally). A file shorter than the job's range
 * is extended (ftruncate, so reads of a new file read zeros).
 *
 * Build: crates/capi/fio/build.sh (against the headers of the fio that
 * loads it, which checks FIO_IOOPS_VERSION). docs/capi.md, "fio".
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fio.h"
#include "optgroup.h"

#include "lwio.h"

#define ENGINE "liblwio"

enum { COMP_INTERRUPT = 0, COMP_POLL = 1 };

/* The engine's options (fio fills them; the first member must not be an
 * option: fio keeps the thread pointer there). */
struct lwio_fio_options {
	void *pad;
	char *url;
	char *token_file;
	char *fingerprint;
	char *known_hosts;
	char *provider;
	unsigned int no_tls;
	unsigned int completion;
	unsigned int credits;
	unsigned int registered;
	unsigned int op_timeout_ms;
	unsigned int batch;
};

static struct fio_option options[] = {
	{
		.name = "lwio_url",
		.lname = "lwio export URL",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct lwio_fio_options, url),
		.help = "lwio://HOST[:PORT]/EXPORT: files are paths on this export",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_token_file",
		.lname = "lwio token file",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct lwio_fio_options, token_file),
		.help = "File holding the export's token (default: LWIO_TOKEN, the default token file, anonymous)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_fingerprint",
		.lname = "lwio server certificate",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct lwio_fio_options, fingerprint),
		.help = "Pin the server's TLS certificate (sha256:AB:CD:...)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_known_hosts",
		.lname = "lwio known_hosts",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct lwio_fio_options, known_hosts),
		.help = "known_hosts file for trust on first use (default: ~/.config/lwio/known_hosts)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_no_tls",
		.lname = "lwio plain TCP",
		.type = FIO_OPT_BOOL,
		.off1 = offsetof(struct lwio_fio_options, no_tls),
		.help = "Plain TCP side channel (a server with tls = false)",
		.def = "0",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_completion",
		.lname = "lwio completion mode",
		.type = FIO_OPT_STR,
		.off1 = offsetof(struct lwio_fio_options, completion),
		.help = "How completions are reaped",
		.def = "interrupt",
		.posval = {
			{ .ival = "interrupt", .oval = COMP_INTERRUPT,
			  .help = "Sleep on completion events" },
			{ .ival = "poll", .oval = COMP_POLL,
			  .help = "Busy-poll (lowest latency, burns a core)" },
		},
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_provider",
		.lname = "lwio RDMA provider",
		.type = FIO_OPT_STR_STORE,
		.off1 = offsetof(struct lwio_fio_options, provider),
		.help = "RDMA provider: soft or verbs (default: auto)",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_credits",
		.lname = "lwio credits",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct lwio_fio_options, credits),
		.help = "Requests in flight to ask of the server (0: liblwio's default)",
		.def = "0",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_registered",
		.lname = "lwio registered buffers",
		.type = FIO_OPT_BOOL,
		.off1 = offsetof(struct lwio_fio_options, registered),
		.help = "I/O buffers from lwio_buf_alloc (registered once: no copy on reads)",
		.def = "1",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_op_timeout",
		.lname = "lwio operation timeout",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct lwio_fio_options, op_timeout_ms),
		.help = "Per-operation timeout in milliseconds (0: liblwio's default)",
		.def = "0",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = "lwio_batch",
		.lname = "lwio batching",
		.type = FIO_OPT_INT,
		.off1 = offsetof(struct lwio_fio_options, batch),
		.help = "Submit what fio queued in one lwio_submit when N are staged or the engine next reaps, and reap all that completed (0: submit at each commit, reap what fio asks for)",
		.def = "32",
		.category = FIO_OPT_C_ENGINE,
		.group = FIO_OPT_G_INVALID,
	},
	{
		.name = NULL,
	},
};

/* One job's state. */
struct lwio_fio_data {
	struct lwio_client *c;
	int poll;
	/* commit() leaves the staged operations to getevents(). */
	int batch;
	/* Queued by queue(), not yet submitted: ops[0..npend). */
	struct lwio_op *ops;
	struct io_u **pend;
	unsigned int npend;
	/* Submitted, not yet reaped. */
	unsigned int nsub;
	/* Completed by this getevents() call, for event(). */
	struct io_u **events;
	unsigned int nevents;
	/* Failed at submit: handed back by the next getevents(). */
	struct io_u **failed;
	unsigned int nfailed;
	/* Reaped, not yet handed to fio: cqes[chead..ctail). */
	struct lwio_cqe *cqes;
	unsigned int chead, ctail;
	unsigned int depth;
	/* The completion fd, asked for at the first getevents() with a
	 * timeout (it costs an eventfd write per completion). */
	int cfd;
	/* td->orig_buffer, and whether lwio_buf_alloc gave it. */
	void *buf;
	int buf_registered;
};

static struct lwio_client *lwio_fio_connect(struct thread_data *td)
{
	struct lwio_fio_options *o = td->eo;
	struct lwio_options opts;
	struct lwio_client *c;
	int fd;

	if (!o || !o->url || !*o->url) {
		log_err(ENGINE ": lwio_url=lwio://HOST[:PORT]/EXPORT is required\n");
		return NULL;
	}
	lwio_options_init(&opts);
	opts.token_file = o->token_file;
	opts.fingerprint = o->fingerprint;
	opts.known_hosts = o->known_hosts;
	opts.no_tls = o->no_tls;
	opts.completion = o->completion == COMP_POLL ? LWIO_COMPLETION_POLL
						      : LWIO_COMPLETION_INTERRUPT;
	opts.provider = o->provider;
	opts.credits = o->credits;
	opts.op_timeout_ms = o->op_timeout_ms;
	c = lwio_connect(o->url, &opts);
	if (!c) {
		log_err(ENGINE ": %s: %s\n", o->url, lwio_errmsg());
		return NULL;
	}
	/* The login does not check the export: its root does (a directory:
	 * EISDIR), so a wrong name fails here, once, and not at each file. */
	fd = lwio_open(c, ".", O_RDONLY, 0);
	if (fd >= 0) {
		lwio_close(fd);
	} else if (fd != -EISDIR) {
		log_err(ENGINE ": %s: %s\n", o->url, lwio_errmsg());
		lwio_disconnect(c);
		return NULL;
	}
	return c;
}

/* Size of `f` on the export (0 when it does not exist yet). */
static int lwio_fio_stat(struct lwio_client *c, struct fio_file *f, uint64_t *size)
{
	struct lwio_stat st;
	int fd, r;

	fd = lwio_open(c, f->file_name, O_RDONLY, 0);
	if (fd == -ENOENT) {
		*size = 0;
		return 0;
	}
	if (fd < 0) {
		log_err(ENGINE ": %s: %s\n", f->file_name, lwio_errmsg());
		return fd;
	}
	r = lwio_fstat(fd, &st);
	if (r < 0)
		log_err(ENGINE ": %s: %s\n", f->file_name, lwio_errmsg());
	else
		*size = st.size;
	lwio_close(fd);
	return r;
}

/* The size fio is told: the file's own when the job gives no size (the
 * job covers the file), else "unknown" (-1, as for any diskless engine):
 * fio then takes size= and open_file() extends a shorter file, where fio
 * would lay it out, instead of limiting the job to what exists. */
static uint64_t lwio_fio_real_size(struct thread_data *td, uint64_t size)
{
	if (td->o.size || td->o.file_size_low)
		return -1ULL;
	return size;
}

/* Whether this job's sizes need the server: not when the job gives its
 * size (lwio_fio_real_size ignores the file's own then). */
static bool lwio_fio_needs_stat(struct thread_data *td)
{
	return !(td->o.size || td->o.file_size_low);
}

/* Stat the files of the job that have no known size yet over `c`, into
 * sizes[i]; 0 or a negative errno. */
static int lwio_fio_stat_unknown(struct thread_data *td, struct lwio_client *c, uint64_t *sizes)
{
	struct fio_file *f;
	unsigned int i;
	int r = 0;

	for_each_file(td, f, i) {
		if (fio_file_size_known(f))
			continue;
		r = lwio_fio_stat(c, f, &sizes[i]);
		if (r < 0)
			break;
	}
	return r;
}

/* The same on a short connection of its own. */
static int lwio_fio_stat_files(struct thread_data *td, uint64_t *sizes)
{
	struct lwio_client *c = lwio_fio_connect(td);
	int r;

	if (!c)
		return -EINVAL;
	r = lwio_fio_stat_unknown(td, c, sizes);
	lwio_disconnect(c);
	return r;
}

/* The same in a child process, the sizes back through a pipe. fio sizes
 * files in its parent process and, unless the job says thread, runs the
 * job in a process forked after that; verbs resources (librdmacm's device
 * contexts, opened once per process at its first use) do not survive a
 * fork, so a parent that had connected over a verbs device leaves the job
 * a librdmacm whose contexts are not its own (its sends fail with "invalid
 * key or access"). A stat made in a child of its own leaves the parent
 * untouched. */
static int lwio_fio_stat_files_forked(struct thread_data *td, uint64_t *sizes, size_t n)
{
	size_t want = n * sizeof(*sizes), got = 0;
	int p[2], status, r;
	pid_t pid;

	if (pipe(p) < 0)
		return -errno;
	pid = fork();
	if (pid < 0) {
		r = -errno;
		close(p[0]);
		close(p[1]);
		return r;
	}
	if (pid == 0) {
		ssize_t w = 0;

		close(p[0]);
		r = lwio_fio_stat_files(td, sizes);
		if (r == 0)
			w = write(p[1], sizes, want);
		_exit(r == 0 && w == (ssize_t)want ? 0 : 1);
	}
	close(p[1]);
	while (got < want) {
		ssize_t k = read(p[0], (char *)sizes + got, want - got);

		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			break;
		got += k;
	}
	close(p[0]);
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	return got == want ? 0 : -EIO;
}

/* Size every file of the job that fio does not know the size of (fio asks
 * before the I/O, in its parent process, before init): without
 * a connection when the job gives its size; with the job's own connection
 * if it has one (init ran); in thread mode, on a short connection; else in
 * a child process (lwio_fio_stat_files_forked says why). */
static int lwio_fio_size_files(struct thread_data *td)
{
	struct lwio_fio_data *d = td->io_ops_data;
	size_t n = td->files_index ? td->files_index : 1;
	struct fio_file *f;
	uint64_t *sizes;
	unsigned int i, unknown = 0;
	int r = 0;

	for_each_file(td, f, i)
		unknown += !fio_file_size_known(f);
	/* fio asks once per file: the first call sized them all. */
	if (!unknown)
		return 0;
	if (!lwio_fio_needs_stat(td)) {
		for_each_file(td, f, i) {
			if (fio_file_size_known(f))
				continue;
			f->real_file_size = -1ULL;
			fio_file_set_size_known(f);
		}
		return 0;
	}
	sizes = calloc(n, sizeof(*sizes));
	if (!sizes)
		return -ENOMEM;
	if (d && d->c) {
		r = lwio_fio_stat_unknown(td, d->c, sizes);
	} else if (td->o.use_thread) {
		r = lwio_fio_stat_files(td, sizes);
	} else {
		r = lwio_fio_stat_files_forked(td, sizes, n);
		if (r < 0)
			log_err(ENGINE ": sizing the job's files failed\n");
	}
	if (r == 0) {
		for_each_file(td, f, i) {
			if (fio_file_size_known(f))
				continue;
			f->real_file_size = lwio_fio_real_size(td, sizes[i]);
			fio_file_set_size_known(f);
		}
	}
	free(sizes);
	return r;
}

static int fio_lwio_setup(struct thread_data *td)
{
	int r = lwio_fio_size_files(td);

	if (r < 0) {
		td_verror(td, -r, "lwio_fstat");
		return 1;
	}
	return 0;
}

static int fio_lwio_get_file_size(struct thread_data *td, struct fio_file *f)
{
	(void)f;
	return fio_lwio_setup(td);
}

static void fio_lwio_cleanup(struct thread_data *td)
{
	struct lwio_fio_data *d = td->io_ops_data;

	if (!d)
		return;
	if (d->buf && d->buf_registered)
		lwio_buf_free(d->buf);
	else
		free(d->buf);
	if (d->c)
		lwio_disconnect(d->c);
	free(d->ops);
	free(d->pend);
	free(d->events);
	free(d->failed);
	free(d->cqes);
	free(d);
	td->io_ops_data = NULL;
}

static int fio_lwio_init(struct thread_data *td)
{
	struct lwio_fio_options *o = td->eo;
	struct lwio_fio_data *d;
	unsigned int depth = td->o.iodepth ? td->o.iodepth : 1;

	d = calloc(1, sizeof(*d));
	if (!d)
		return 1;
	td->io_ops_data = d;
	d->depth = depth;
	d->cfd = -1;
	d->ops = calloc(depth, sizeof(*d->ops));
	d->pend = calloc(depth, sizeof(*d->pend));
	d->events = calloc(depth, sizeof(*d->events));
	d->failed = calloc(depth, sizeof(*d->failed));
	d->cqes = calloc(depth, sizeof(*d->cqes));
	if (!d->ops || !d->pend || !d->events || !d->failed || !d->cqes) {
		fio_lwio_cleanup(td);
		return 1;
	}
	d->c = lwio_fio_connect(td);
	if (!d->c) {
		td_verror(td, EINVAL, "lwio_connect");
		fio_lwio_cleanup(td);
		return 1;
	}
	d->poll = o->completion == COMP_POLL;
	d->batch = o->batch;
	return 0;
}

/* fio's I/O buffers: registered with the client once, for the job. */
static int fio_lwio_iomem_alloc(struct thread_data *td, size_t total)
{
	struct lwio_fio_options *o = td->eo;
	struct lwio_fio_data *d = td->io_ops_data;

	if (o->registered) {
		d->buf = lwio_buf_alloc(d->c, total);
		if (!d->buf) {
			log_err(ENGINE ": lwio_buf_alloc(%zu): %s\n", total, lwio_errmsg());
			return 1;
		}
		d->buf_registered = 1;
	} else if (posix_memalign(&d->buf, page_size, total)) {
		d->buf = NULL;
		return 1;
	}
	td->orig_buffer = d->buf;
	return 0;
}

static void fio_lwio_iomem_free(struct thread_data *td)
{
	struct lwio_fio_data *d = td->io_ops_data;

	if (d && d->buf) {
		if (d->buf_registered)
			lwio_buf_free(d->buf);
		else
			free(d->buf);
		d->buf = NULL;
	}
	td->orig_buffer = NULL;
}

static int lwio_fio_open_flags(struct thread_data *td)
{
	int flags = td_write(td) ? O_RDWR | O_CREAT : O_RDONLY;

	if (td->o.odirect)
		flags |= O_DIRECT;
	if (td->o.sync_io)
		flags |= O_SYNC;
	return flags;
}

static int fio_lwio_open_file(struct thread_data *td, struct fio_file *f)
{
	struct lwio_fio_data *d = td->io_ops_data;
	uint64_t need = f->file_offset + f->io_size;
	struct lwio_stat st;
	int fd;

	fd = lwio_open(d->c, f->file_name, lwio_fio_open_flags(td), 0644);
	if (fd == -ENOENT && !td_write(td)) {
		/* A read job on a new file: create it (and extend it below),
		 * as fio lays out the files of a read job. */
		fd = lwio_open(d->c, f->file_name, O_RDWR | O_CREAT, 0644);
		if (fd >= 0)
			lwio_close(fd);
		fd = lwio_open(d->c, f->file_name, lwio_fio_open_flags(td), 0644);
	}
	if (fd < 0) {
		log_err(ENGINE ": %s: %s\n", f->file_name, lwio_errmsg());
		td_verror(td, -fd, "lwio_open");
		return 1;
	}
	if (lwio_fstat(fd, &st) == 0 && st.size < need && f->io_size != -1ULL) {
		/* Shorter than the job's range: extend it (sparse). */
		int wfd = td_write(td) ? fd : lwio_open(d->c, f->file_name, O_RDWR, 0);
		int r = wfd < 0 ? wfd : lwio_ftruncate(wfd, need);

		if (r < 0) {
			log_err(ENGINE ": %s: extending to %llu bytes: %s\n", f->file_name,
				(unsigned long long) need, lwio_errmsg());
			td_verror(td, -r, "lwio_ftruncate");
			if (wfd >= 0 && wfd != fd)
				lwio_close(wfd);
			lwio_close(fd);
			return 1;
		}
		if (wfd != fd)
			lwio_close(wfd);
	}
	f->engine_pos = (uint64_t) fd;
	f->fd = -1;
	return 0;
}

static int fio_lwio_close_file(struct thread_data *td, struct fio_file *f)
{
	int r = lwio_close((int) f->engine_pos);

	(void) td;
	f->engine_pos = (uint64_t) -1;
	return r < 0 ? -r : 0;
}

static enum fio_q_status fio_lwio_queue(struct thread_data *td, struct io_u *io_u)
{
	struct lwio_fio_data *d = td->io_ops_data;
	int fd = (int) io_u->file->engine_pos;
	struct lwio_op *op;

	fio_ro_check(td, io_u);

	if (ddir_sync(io_u->ddir)) {
		int r;

		/* In order with the writes before it: after they are reaped. */
		if (d->npend + d->nsub)
			return FIO_Q_BUSY;
		if (fio_fill_issue_time(td))
			fio_gettime(&io_u->issue_time, NULL);
		r = lwio_fsync(fd, io_u->ddir != DDIR_SYNC);
		if (r < 0) {
			io_u->error = -r;
			td_verror(td, io_u->error, "lwio_fsync");
		}
		return FIO_Q_COMPLETED;
	}
	if (io_u->ddir != DDIR_READ && io_u->ddir != DDIR_WRITE) {
		io_u->error = EOPNOTSUPP;
		td_verror(td, io_u->error, "trim is not supported by " ENGINE);
		return FIO_Q_COMPLETED;
	}
	if (d->npend + d->nsub >= d->depth)
		return FIO_Q_BUSY;
	op = &d->ops[d->npend];
	op->user_data = (uint64_t) (uintptr_t) io_u;
	op->fd = fd;
	op->opcode = io_u->ddir == DDIR_READ ? LWIO_OP_READ : LWIO_OP_WRITE;
	op->buf = io_u->xfer_buf;
	op->len = io_u->xfer_buflen;
	op->offset = io_u->offset;
	d->pend[d->npend++] = io_u;
	return FIO_Q_QUEUED;
}

/* Drop the first `n` staged operations (submitted or failed). */
static void lwio_fio_unstage(struct lwio_fio_data *d, unsigned int n)
{
	d->npend -= n;
	memmove(d->ops, d->ops + n, d->npend * sizeof(*d->ops));
	memmove(d->pend, d->pend + n, d->npend * sizeof(*d->pend));
}

/* Submit the staged operations, in one lwio_submit when there is room. */
static void lwio_fio_submit(struct thread_data *td)
{
	struct lwio_fio_data *d = td->io_ops_data;

	while (d->npend) {
		int r = lwio_submit(d->c, d->ops, d->npend);

		if (r > 0) {
			if (fio_fill_issue_time(td)) {
				struct timespec now;
				int i;

				fio_gettime(&now, NULL);
				for (i = 0; i < r; i++) {
					d->pend[i]->issue_time = now;
					io_u_queued(td, d->pend[i]);
				}
			}
			io_u_mark_submit(td, r);
			d->nsub += r;
			lwio_fio_unstage(d, r);
		} else if (r == -EAGAIN && d->nsub) {
			/* No room until some are reaped: getevents() submits
			 * the rest. */
			break;
		} else {
			/* The first one failed: complete it with its error. */
			struct io_u *io_u = d->pend[0];

			if (r == 0)
				r = -EIO;
			log_err(ENGINE ": %s: %s\n", io_u->file->file_name, lwio_errmsg());
			io_u->error = -r;
			io_u_mark_submit(td, 1);
			d->failed[d->nfailed++] = io_u;
			lwio_fio_unstage(d, 1);
		}
	}
}

/*
 * With lwio_batch=N (default 32) the operations stay staged until N are
 * or the engine next reaps (a getevents() that finds no completion left from
 * the last reap): what fio queues meanwhile goes in one lwio_submit, one
 * doorbell, instead of one per I/O. fio always waits for its I/Os
 * (io_u_quiesce) before it sleeps for thinktime or a rate, and at the end
 * of a job, so nothing stays staged across a sleep.
 */
static int fio_lwio_commit(struct thread_data *td)
{
	struct lwio_fio_data *d = td->io_ops_data;

	if (!d->batch || d->npend >= d->batch)
		lwio_fio_submit(td);
	return 0;
}

/* Hand completions reaped earlier to fio, up to `max` events. */
static void lwio_fio_take(struct lwio_fio_data *d, unsigned int max)
{
	while (d->chead < d->ctail && d->nevents < max) {
		struct lwio_cqe *cqe = &d->cqes[d->chead++];
		struct io_u *io_u = (struct io_u *) (uintptr_t) cqe->user_data;

		if (cqe->res < 0) {
			io_u->error = (int) -cqe->res;
		} else {
			io_u->error = 0;
			io_u->resid = io_u->xfer_buflen - (unsigned long long) cqe->res;
		}
		d->events[d->nevents++] = io_u;
	}
}

static int64_t lwio_fio_ns_until(const struct timespec *end)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (int64_t) (end->tv_sec - now.tv_sec) * 1000000000LL + (end->tv_nsec - now.tv_nsec);
}

/*
 * At least `min` events, at most `max`; without a timeout (t NULL) it
 * waits for `min`, with one it waits at most that long. With lwio_batch,
 * every completion lwio_reap has is taken (into cqes) and handed to fio
 * as it asks: fio asks for one event at a time by default
 * (iodepth_batch_complete_max = iodepth_batch_complete_min = 1), and the
 * next calls then need no liblwio call, while the I/Os fio queues
 * meanwhile wait staged and go in one lwio_submit when the engine next
 * reaps.
 */
static int fio_lwio_getevents(struct thread_data *td, unsigned int min, unsigned int max,
			      const struct timespec *t)
{
	struct lwio_fio_data *d = td->io_ops_data;
	struct timespec end;
	int timed = t != NULL, r;

	d->nevents = 0;
	if (max > d->depth)
		max = d->depth;
	if (min > max)
		min = max;
	if (timed) {
		clock_gettime(CLOCK_MONOTONIC, &end);
		end.tv_sec += t->tv_sec;
		end.tv_nsec += t->tv_nsec;
		if (end.tv_nsec >= 1000000000L) {
			end.tv_sec++;
			end.tv_nsec -= 1000000000L;
		}
	}
	for (;;) {
		unsigned int want, room;

		/* Failed submissions, then completions reaped before. */
		while (d->nfailed && d->nevents < max)
			d->events[d->nevents++] = d->failed[--d->nfailed];
		lwio_fio_take(d, max);
		if (d->nevents >= max || (d->nevents && d->nevents >= min && d->batch))
			break;
		/* The cache is empty: submit what is staged, and reap. */
		if (d->npend)
			lwio_fio_submit(td);
		if (d->nfailed)
			continue;
		if (!d->nsub)
			break;
		/* Wait (without a timeout; with one, below) for min. */
		want = 0;
		if (!timed && d->nevents < min)
			want = min - d->nevents < d->nsub ? min - d->nevents : d->nsub;
		room = d->batch ? d->depth : max - d->nevents;
		r = lwio_reap(d->c, d->cqes, want, room);
		if (r < 0) {
			log_err(ENGINE ": lwio_reap: %s\n", lwio_errmsg());
			return r;
		}
		d->chead = 0;
		d->ctail = r;
		d->nsub -= r;
		lwio_fio_take(d, max);
		if (d->nevents >= min && (r == 0 || d->nevents >= max || d->batch))
			break;
		if (d->nevents >= min || r > 0)
			continue;
		if (!timed)
			continue;
		/* With a timeout and nothing complete: wait for one, at most
		 * until the deadline. */
		if (lwio_fio_ns_until(&end) <= 0)
			break;
		if (!d->poll) {
			/* Sleep on the completion fd until one completes or
			 * the time is up. */
			int64_t left = lwio_fio_ns_until(&end);
			struct pollfd p;
			uint64_t v;

			if (d->cfd < 0)
				d->cfd = lwio_completion_fd(d->c);
			if (d->cfd >= 0) {
				p.fd = d->cfd;
				p.events = POLLIN;
				if (poll(&p, 1, (int) ((left + 999999) / 1000000)) > 0 &&
				    read(d->cfd, &v, sizeof(v)) < 0 && errno != EAGAIN)
					return -errno;
			}
		}
	}
	return (int) d->nevents;
}

static struct io_u *fio_lwio_event(struct thread_data *td, int event)
{
	struct lwio_fio_data *d = td->io_ops_data;

	return d->events[event];
}

struct ioengine_ops ioengine = {
	.name = ENGINE,
	.version = FIO_IOOPS_VERSION,
	.flags = FIO_DISKLESSIO | FIO_NODISKUTIL | FIO_ASYNCIO_SETS_ISSUE_TIME,
	.setup = fio_lwio_setup,
	.init = fio_lwio_init,
	.queue = fio_lwio_queue,
	.commit = fio_lwio_commit,
	.getevents = fio_lwio_getevents,
	.event = fio_lwio_event,
	.cleanup = fio_lwio_cleanup,
	.open_file = fio_lwio_open_file,
	.close_file = fio_lwio_close_file,
	.get_file_size = fio_lwio_get_file_size,
	.iomem_alloc = fio_lwio_iomem_alloc,
	.iomem_free = fio_lwio_iomem_free,
	.options = options,
	.option_struct_size = sizeof(struct lwio_fio_options),
};
