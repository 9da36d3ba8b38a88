/* The check macro of the single-process C tests (verbs_errors.c, more_verbs.c, post_lists.c,
 * close_device.c): counts the check, and on failure names the file, the line, the condition
 * and errno, and exits 1. The two-process tests use forked.h's, which also names the side. */
#ifndef SOFTWARP_TESTS_CHECK_H
#define SOFTWARP_TESTS_CHECK_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

static int checks;

#define CHECK(cond)                                                              \
	do {                                                                     \
		checks++;                                                        \
		if (!(cond)) {                                                   \
			fprintf(stderr, "%s:%d: failed: %s (errno %d)\n",        \
				__FILE__, __LINE__, #cond, errno);               \
			exit(1);                                                 \
		}                                                                \
	} while (0)

#endif
