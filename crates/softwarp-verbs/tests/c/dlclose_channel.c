/* A library that uses librdmacm and closes what it opened in its destructor, unloaded with
 * dlclose right after it opened it, as uDAPL's provider is by dapltest's limit test: the
 * destructor runs under the dynamic loader's lock, and its rdma_destroy_event_channel must
 * not wait for anything that needs that lock (the library's thread, still starting, did).
 *
 * Built twice from this file: with -DPLUGIN as a shared library (linked with -lrdmacm),
 * and as the program, which loads it, has it create an event channel and unloads it
 * ROUNDS times, and prints "ok: N rounds". Every wait is bounded (alarm).
 *
 *   cc -DPLUGIN -shared -fPIC -o libplugin.so dlclose_channel.c -lrdmacm
 *   cc -o dlclose_channel dlclose_channel.c -ldl && ./dlclose_channel ./libplugin.so
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#ifdef PLUGIN
#include <rdma/rdma_cma.h>

static struct rdma_event_channel *channel;

int plugin_open(void)
{
	channel = rdma_create_event_channel();
	return channel ? 0 : -1;
}

__attribute__((destructor)) static void plugin_close(void)
{
	if (channel)
		rdma_destroy_event_channel(channel);
}
#else
#define ROUNDS 200

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s PLUGIN\n", argv[0]);
		return 2;
	}
	alarm(60);
	for (int i = 0; i < ROUNDS; i++) {
		void *plugin = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
		if (!plugin) {
			fprintf(stderr, "dlopen: %s\n", dlerror());
			return 1;
		}
		int (*open_it)(void) = (int (*)(void))dlsym(plugin, "plugin_open");
		if (!open_it || open_it()) {
			fprintf(stderr, "round %d: plugin_open failed\n", i);
			return 1;
		}
		dlclose(plugin);
	}
	printf("ok: %d rounds\n", ROUNDS);
	return 0;
}
#endif
